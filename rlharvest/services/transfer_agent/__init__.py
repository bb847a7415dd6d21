"""Transfer agent: holds weight versions in host memory; trainers publish, workers pull.

Pure core (no I/O): ``delta_codec`` (lossless sparse deltas), ``checksum``, ``sharding`` (TP
slices), ``bucketing`` (buckets + manifest), ``version_store`` (last K versions, pull plans),
``apply`` (worker side of a pull), ``relay`` (cross-cluster scatter-then-broadcast plans),
``core`` (the jobs an agent holds, what it admits and refuses, idle drops). ``service`` is the
thin servicer around ``core``; ``client`` the one client; ``protocol`` what both share.
"""
