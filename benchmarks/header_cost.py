"""What a message header costs on the device: a point-to-point message that carries its shapes sends a small
int64 header first, which the receiver reads on the host before it allocates the payload. On CUDA (NCCL has no
host backend) the header lives on the GPU, so per message the sender pays one host-to-device copy of it and the
receiver one device-to-host copy (a wait for the stream); on a mixed ``"cpu:gloo,cuda:nccl"`` group it would
travel on the host instead, a separate gloo round trip. This prints the device-side cost per header, measured,
next to the time the GPU needs to copy one payload of the sizes a pipeline sends (a T=4096, hidden-4096 bf16
activation is 32 MiB), so the ratio says what a device header adds to a message.

    python benchmarks/header_cost.py [--device cuda] [--repeats 200]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    values = list(range(11))

    def header_round_trip() -> None:
        header = torch.tensor(values, dtype=torch.int64, device=device)  # the sender's copy to the device
        header.tolist()  # the receiver's wait and copy back

    for _ in range(20):
        header_round_trip()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        header_round_trip()
    sync()
    per_header = (time.perf_counter() - t0) / args.repeats
    print(f"device={device} header (11 x int64) to the device and back: {per_header * 1e6:.1f} us per message")
    for mib in (1, 8, 32):
        src = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        for _ in range(5):
            dst.copy_(src)
        sync()
        t0 = time.perf_counter()
        for _ in range(20):
            dst.copy_(src)
        sync()
        copy = (time.perf_counter() - t0) / 20
        print(f"  payload {mib:>2} MiB: one device copy {copy * 1e6:8.1f} us; header / copy = {per_header / copy:.2f}")


if __name__ == "__main__":
    main()
