"""Generated from protos/ by `make protos`; do not edit."""
