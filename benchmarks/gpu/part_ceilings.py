"""The device's own ceilings, measured once so other parts report % of them (METHOD.md: datasheet
rates are leads, the measured ones are the yardstick).

- bf16 and tf32/fp32 matrix products of 8192³ (4096³ in a rehearsal) on random data (zeros run
  faster and would flatter every ratio), TFLOP/s = 2·n³ / median time;
- a device-to-device copy of 2 GiB, GB/s counting the bytes read and the bytes written.
"""

from __future__ import annotations

import torch
from common import device, figure, interleaved_ms, median, parse_out, pick, write_part


def matmul_tflops(n: int, dtype: torch.dtype, dev: torch.device, rounds: int) -> list[float]:
    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=generator)
    times = interleaved_ms({"mm": lambda: a @ b}, warmup=3, rounds=rounds)["mm"]
    return [2 * n**3 / (t * 1e-3) / 1e12 for t in times]


def copy_gb_s(size_bytes: int, dev: torch.device, rounds: int) -> list[float]:
    source = torch.rand(size_bytes // 4, device=dev)
    target = torch.empty_like(source)
    times = interleaved_ms({"copy": lambda: target.copy_(source)}, warmup=3, rounds=rounds)["copy"]
    return [2 * size_bytes / (t * 1e-3) / 1e9 for t in times]


def main() -> None:
    out = parse_out()
    dev = device()
    n, rounds = pick(8192, 512), pick(20, 3)
    bf16 = matmul_tflops(n, torch.bfloat16, dev, rounds)
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = matmul_tflops(n, torch.float32, dev, pick(10, 3))
    torch.backends.cuda.matmul.allow_tf32 = True
    tf32 = matmul_tflops(n, torch.float32, dev, pick(10, 3))
    torch.backends.cuda.matmul.allow_tf32 = False
    copy = copy_gb_s(pick(2 * 2**30, 64 * 2**20), dev, rounds)
    figures = [
        {
            **figure(
                f"bf16 matmul {n}³", median(bf16), "TFLOP/s", note=f"range {min(bf16):.1f}–{max(bf16):.1f}"
            ),
            "key": "bf16_tflops",
        },
        {
            **figure(
                f"tf32 matmul {n}³", median(tf32), "TFLOP/s", note=f"range {min(tf32):.1f}–{max(tf32):.1f}"
            ),
            "key": "tf32_tflops",
        },
        {
            **figure(
                f"fp32 matmul {n}³", median(fp32), "TFLOP/s", note=f"range {min(fp32):.1f}–{max(fp32):.1f}"
            ),
            "key": "fp32_tflops",
        },
        {
            **figure("device-to-device copy", median(copy), "GB/s", note="read + written bytes"),
            "key": "copy_gb_s",
        },
    ]
    write_part(out, "ceilings", figures)


if __name__ == "__main__":
    main()
