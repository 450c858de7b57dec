"""The header of a safetensors file, read and checked before any tensor is: safetensors allocates
what the header declares, so its length, its number of tensors and each tensor's dtype, shape and
place in the file are bounded here first."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from lora_bench.errors import CheckpointError
from lora_bench.model.sizes import MAX_BLOCKS
from lora_bench.safe_yaml import short_repr

MAX_HEADER_BYTES = 16 << 20  # the safetensors header of GPT-2 1558M: about 60 KB
MAX_TENSORS = 16 * (MAX_BLOCKS + 1)  # a block holds 12 tensors, 14 with the old mask buffers
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _bad_header(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is truncated or not a safetensors file of GPT-2 ({why}); delete it to have "
                           "it downloaded again, or pass --weights-dir")


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, read and checked before any
    tensor: a header of at most MAX_HEADER_BYTES and MAX_TENSORS entries, each a known dtype with a
    shape of a few dimensions whose bytes lie inside the file and match the shape."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise _bad_header(path, f"{size} bytes, shorter than a header")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise _bad_header(path, f"its header declares {n:,} bytes (the file has {size:,}; a header may have "
                                    f"{MAX_HEADER_BYTES:,})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        raise _bad_header(path, "its header is not JSON") from None
    if not isinstance(header, dict) or len(header) > MAX_TENSORS + 1:
        raise _bad_header(path, f"its header is not a mapping of at most {MAX_TENSORS:,} tensors")
    data = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
                                                      for x in v)
        if dtype not in _DTYPE_BYTES or not ints(shape) or len(shape) > 4 or not ints(offsets) or len(offsets) != 2:
            raise _bad_header(path, f"tensor {short_repr(name)} has no dtype, shape and data offsets lora-bench reads")
        begin, end = offsets
        if not begin <= end <= data or end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise _bad_header(path, f"tensor {short_repr(name)} of shape {short_repr(tuple(shape))} does not lie in "
                                    f"the file's {data:,} bytes of data")
        out[name] = (dtype, tuple(shape))
    return out
