"""A drafter's weight matrices committed as int8 rows, each row with its own scale.

The EAGLE-3 head is committed this way: in float16 its checkpoint would be 19.7 MB (its LM
head over 8,192 draft tokens alone 9.4 MB), packed it is 10 MB, and the repository's whole
tree must stay under 48 MB. The committed folder holds

    model.safetensors       every tensor that is not a 2-D float weight (norms, d2t, t2d)
    int8_rows.safetensors   for each 2-D float weight NAME [R, C]:
                              NAME            int8 [R, C]   round(row / scale)
                              NAME.row_scale  float32 [R]   max |row| / 127
                            metadata "dtype": the trained checkpoint's float dtype

and setup (`unpack`) writes the upstream layout again: one `model.safetensors` with every
weight as `NAME * NAME.row_scale` in float32, the products exactly (every other tensor as
committed). Any loader takes float32; the engine's CPU kernels find the int8 rows in it
again and read one byte a weight (`cpu_streamed.int8_blocks`), where float16 values,
rounded from the products, would have cost two. A value moves by at most half its row's
scale (0.4 % of the row's largest value) from the trained one. On the 45 held-out chat
requests that left EAGLE-3's τ where it was (round 15's head 2.809 in float16, 2.812
packed; round 14's 2.762 and 2.756), while packing the EAGLE-1 head as well cost it 0.015
(2.286 to 2.271), so that head stays float16. Whatever the rounding, drafting stays lossless: the target verifies
every draft.

    python tools/packed_rows.py pack .cache/train/round15/eagle3 checkpoints/smollm2-135m-instruct/eagle3
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

PACKED_FILE = "int8_rows.safetensors"
HEAD_FILE = "model.safetensors"
SCALE = ".row_scale"
NOT_SERVED = ("training.json",)  # kept beside the committed head, not copied into the served one


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R, C] -> (int8 [R, C], float32 scale [R]); an all-zero row gets scale 1."""
    rows = rows.float()
    scale = rows.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (rows / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize`, up to its rounding: [R, C] in `dtype`."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def pack(head_dir: Path, out_dir: Path) -> None:
    """A drafter folder (upstream layout, one `model.safetensors`) -> the committed folder."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(head_dir / HEAD_FILE))
    matrices = [name for name, t in state.items() if t.dim() == 2 and t.is_floating_point()]
    dtypes = {state[name].dtype for name in matrices}
    if len(dtypes) != 1:
        raise ValueError(f"{head_dir / HEAD_FILE}: expected one float dtype, got {sorted(map(str, dtypes))}")
    packed = {}
    for name in matrices:
        packed[name], packed[name + SCALE] = quantize(state.pop(name))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / HEAD_FILE), metadata={"format": "pt"})
    save_file(packed, str(out_dir / PACKED_FILE), metadata={"format": "pt", "dtype": str(dtypes.pop())})
    for f in head_dir.iterdir():
        if f.is_file() and f.name != HEAD_FILE:
            shutil.copy(f, out_dir / f.name)


def unpack(committed_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """The committed folder -> the upstream layout in `out_dir`, its matrices in `dtype`
    (float32, the products exactly; float16 is how setup wrote them until 2026-12-02, kept
    to compare with). A folder without `int8_rows.safetensors` is copied as it is."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for f in committed_dir.iterdir():
        if f.is_file() and f.name not in (PACKED_FILE, HEAD_FILE, *NOT_SERVED):
            shutil.copy(f, out_dir / f.name)
    packed_path = committed_dir / PACKED_FILE
    if not packed_path.is_file():
        shutil.copy(committed_dir / HEAD_FILE, out_dir / HEAD_FILE)
        return
    state = load_file(str(committed_dir / HEAD_FILE))
    with safe_open(str(packed_path), framework="pt") as f:
        packed = {name: f.get_tensor(name) for name in f.keys()}
    for name in (n for n in packed if not n.endswith(SCALE)):
        if name in state:
            raise ValueError(f"{committed_dir}: both {HEAD_FILE} and {PACKED_FILE} hold {name}")
        state[name] = dequantize(packed[name], packed[name + SCALE], dtype)
    save_file(state, str(out_dir / HEAD_FILE), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("pack", "unpack"))
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="unpack: the matrices' dtype (default float32, the int8 rows' products exactly)")
    args = ap.parse_args(argv)
    if args.action == "pack":
        pack(args.src, args.out)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        unpack(args.src, args.out, getattr(torch, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
