"""Sparse weight-delta codec vs dense transfer (ROSE §4.2, Fig. 10-11, App. F).

For a Qwen3-shaped bf16 model, version v+1 differs from v in 10%, 1% or 0.1% of the elements
(ROSE Fig. 11a: ~99% zeros for Qwen3-8B). Every form runs in the same process on the same tensors:

  dense   encode_dense (copy + CRC-32) on the agent, decode into the worker's buffer (copy + CRC)
  COO     encode_delta(encoding=COO) against v: per-64K-block counts, u16 offsets, XOR values
  BITMAP  encode_delta(encoding=BITMAP): one bit per element, XOR values of the set bits
  pick    encode_delta choosing per tensor (what the agent sends): the smallest of the three

Sparse forms decode applied in place to the worker's copy of v, verified by linear sums against
the sum the worker recorded for v (the agent knows v's too). Printed per form: bytes on the
wire, encode and decode time, codec throughput (GB of model per second), and the end-to-end
speedup over dense (codec + bytes / link) for a few link speeds. The links are modelled here
(bytes / bandwidth); the measured network path is benchmarked separately.

    python bench/transfer_codec.py            # ~190 MB of bf16, < 2 min
    python bench/transfer_codec.py --quick    # ~24 MB, < 20 s
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from rlharvest.services.transfer_agent.checksum import tensor_linear_sum
from rlharvest.services.transfer_agent.delta_codec import (
    Encoding,
    decode,
    encode_delta,
    encode_dense,
)

from rlharvest.sim.ratios import spread  # noqa: E402
from results_file import results_path  # noqa: E402

LINKS_GBPS = (1, 20, 100)  # WEAVE/ROSE cross-cluster Ethernet is 20 Gbps
ZERO_FRACTIONS = (0.9, 0.99, 0.999)
FORMS = ("dense", "COO", "BITMAP", "pick")  # dense first: the baseline of the others' speedup


def qwen3_layer_shapes(hidden: int, intermediate: int, kv_dim: int) -> dict[str, tuple[int, ...]]:
    return {
        "q_proj": (hidden, hidden), "k_proj": (kv_dim, hidden), "v_proj": (kv_dim, hidden),
        "o_proj": (hidden, hidden), "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate),
        "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
    }


def make_versions(layers: int, hidden: int, intermediate: int, zero_fraction: float,
                  seed: int) -> tuple[dict, dict]:
    """v and v+1: a ``1 - zero_fraction`` share of each tensor's elements has a flipped low bit."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for layer in range(layers):
        for name, shape in qwen3_layer_shapes(hidden, intermediate, hidden // 4).items():
            key = f"model.layers.{layer}.{name}.weight"
            w = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(torch.bfloat16)
            changed = w.clone()
            bits = changed.view(-1).view(torch.int16).numpy()
            k = int(bits.size * (1 - zero_fraction))
            bits[rng.integers(0, bits.size, k)] ^= 1  # duplicates make it a hair sparser
            old[key], new[key] = w, changed
    return old, new


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def encoder(form: str, sums: dict[str, int]):
    """The agent-side encode of one form, as f(name, old, new) -> EncodedTensor; the base's
    linear sum is known (the agent learned it with the version before)."""
    if form == "dense":
        return lambda name, old, new: encode_dense(new)
    encoding = None if form == "pick" else Encoding[form]
    return lambda name, old, new: encode_delta(old, new, encoding=encoding, base_sum=sums[name])


def run_form(old: dict, new: dict, sums: dict[str, int], form: str) -> tuple[int, float, float, dict]:
    """(wire bytes, encode s, decode s, encodings used) of one round of one form. Deltas
    decode in place into the worker's copy of v, verified against its recorded sums."""
    encode = encoder(form, sums)
    held = {k: t.clone() for k, t in old.items()}  # the worker's copy of v, outside the timer
    enc_s, encoded = timed(lambda: {k: encode(k, old[k], new[k]) for k in new})
    dec_s, decoded = timed(lambda: {k: decode(e, held[k], inplace=True, base_sum=sums[k])
                                    for k, e in encoded.items()})
    assert all(torch.equal(decoded[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    used: dict[str, int] = {}
    for e in encoded.values():
        used[e.encoding.name] = used.get(e.encoding.name, 0) + 1
    return sum(e.nbytes for e in encoded.values()), enc_s, dec_s, used


def rounds_of(old: dict, new: dict, repeat: int) -> dict[str, list[tuple[int, float, float, dict]]]:
    """Every form once per round, the order rotating, ``repeat`` rounds."""
    sums = {k: tensor_linear_sum(t) for k, t in old.items()}
    results: dict[str, list] = {form: [] for form in FORMS}
    for r in range(repeat):
        for form in FORMS[r % len(FORMS):] + FORMS[:r % len(FORMS)]:
            results[form].append(run_form(old, new, sums, form))
    return results


def e2e_seconds(wire_bytes: int, enc_s: float, dec_s: float, gbps: float) -> float:
    return enc_s + wire_bytes / (gbps * 1e9 / 8) + dec_s


def checksum_rates(data: bytes) -> dict[str, float]:
    rates = {}
    for name, fn in (("crc32", zlib.crc32),
                     ("blake2b-64", lambda b: hashlib.blake2b(b, digest_size=8).digest())):
        seconds, _ = timed(lambda: fn(data))
        rates[name] = len(data) / seconds / 1e9
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~24 MB model, two rounds")
    parser.add_argument("--out", default=None, help="default bench/results/transfer_codec.md "
                        "(transfer_codec_quick.md with --quick)")
    args = parser.parse_args()
    layers, hidden, intermediate, repeat = (1, 1024, 3072, 2) if args.quick else (2, 2048, 6144, 3)

    lines = ["# transfer_codec: sparse weight deltas vs dense", "",
             f"`python bench/transfer_codec.py{' --quick' if args.quick else ''}` — bf16, "
             f"{layers} Qwen3-shaped layer(s) (hidden {hidden}, intermediate {intermediate}); "
             f"{repeat} rounds, forms interleaved; times are medians, speedups per round: "
             f"median [spread]; torch threads {torch.get_num_threads()}; "
             f"1-min load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.", ""]
    header = ("| zeros | form | wire MB | wire / dense | encodings | enc s | dec s | "
              "codec GB/s | " + " | ".join(f"e2e vs dense @{g} Gbps" for g in LINKS_GBPS) + " |")
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for i, zeros in enumerate(ZERO_FRACTIONS):
        old, new = make_versions(layers, hidden, intermediate, zeros, seed=i)
        model_bytes = sum(t.numel() * t.element_size() for t in new.values())
        results = rounds_of(old, new, repeat)
        dense = results["dense"]
        for form, runs in results.items():
            wire, used = runs[0][0], runs[0][3]
            enc_s = statistics.median(r[1] for r in runs)
            dec_s = statistics.median(r[2] for r in runs)
            speedups = [spread([e2e_seconds(d[0], d[1], d[2], g) / e2e_seconds(*r[:3], g)
                                for d, r in zip(dense, runs)], 1) for g in LINKS_GBPS]
            lines.append(
                f"| {zeros:.1%} | {form} | {wire / 1e6:.2f} | {wire / dense[0][0]:.2%} | "
                f"{', '.join(f'{k} {v}' for k, v in sorted(used.items()))} | {enc_s:.3f} | "
                f"{dec_s:.3f} | {model_bytes / (enc_s + dec_s) / 1e9:.2f} | "
                + " | ".join(speedups) + " |")
            print(lines[-1], flush=True)
    sample = b"".join(encode_dense(t).payload for t in list(new.values())[:4])
    rates = checksum_rates(sample)
    lines += ["", "Checksum over %d MB: " % (len(sample) // 10**6)
              + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items())
              + " (crc32 is used; xxhash is not installed).", "",
              "e2e = encode + wire bytes / link + decode of each form vs the dense row's, same "
              "tensors; the link term is modelled (bytes / bandwidth), the codec terms are "
              "measured. COO costs 2 + itemsize bytes per change plus 4 per 64K block, BITMAP "
              "1/8 byte per element plus itemsize per change: whatever the dtype they cost the "
              "same at 1/16 of the elements changed (93.75% zeros); COO is smaller above it."]
    print("\n".join(lines[-3:]))
    # --quick (what `make bench` runs) must not overwrite the full results the README cites.
    out = Path(args.out) if args.out else results_path("transfer_codec", args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
