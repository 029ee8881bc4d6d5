"""The codes and per-block fields of a GGUF file's quantized blocks, read from the file's
bytes and written back, bit for bit (cpu_blocks.py packs them into panels and unpacks them).

`Fields`: "q", the unsigned integer codes [n, k] uint8 (Q8_0's signed bytes as q + 128;
the others' codes are unsigned in the file too), and per format its per-block fields: fp16
ones ("d", "m", "dmin") as the file's raw bytes [n, nb, 2], scales unpacked to one byte
each ("sc", "mn") [n, nb, S]. A block's weight is the format's function of them
(cpu_blocks.py's docstring lists each).
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT
from torch import Tensor

Fields = dict[str, Tensor]

# Bits of each format's codes.
CODE_BITS = {"q4_0": 4, "q4_1": 4, "q8_0": 8, "q4_k": 4, "q5_k": 5, "q6_k": 6}


def _nibbles32(qs: Tensor) -> Tensor:
    """[..., 16] bytes of a 32-block (byte i: weight i low, i + 16 high) -> [..., 32]."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _kquant_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins [..., 12] -> sc, mn [..., 8]."""
    s = scales.to(torch.int32)
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (torch.cat((lo_sc, hi_sc), -1).to(torch.uint8),
            torch.cat((lo_mn, hi_mn), -1).to(torch.uint8))


def _pack_kquant_scales(sc: Tensor, mn: Tensor) -> Tensor:
    """`_kquant_scales` undone: sc, mn [..., 8] (6-bit) -> [..., 12]."""
    sc, mn = sc.to(torch.int32), mn.to(torch.int32)
    first = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    second = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    third = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    return torch.cat((first, second, third), -1).to(torch.uint8)


def file_fields(blocks: Tensor, block_type: str) -> Fields:
    """A file's blocks [n, row_bytes] -> codes and fields."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, GGML_QUANT_SIZES[GT[block_type.upper()]][1])
    if block_type in ("q4_0", "q4_1", "q8_0"):
        start = 4 if block_type == "q4_1" else 2
        raw = b[..., start:]
        q = _nibbles32(raw) if block_type != "q8_0" else raw ^ 0x80
        fields = {"q": q.reshape(n, -1), "d": b[..., 0:2]}
        if block_type == "q4_1":
            fields["m"] = b[..., 2:4]
        return fields
    if block_type in ("q4_k", "q5_k"):
        sc, mn = _kquant_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(n, -1, 4, 32)  # 64-weight pieces: sub-block 2i low, 2i + 1 high
        q = torch.stack((qs & 0x0F, qs >> 4), dim=3)  # [n, nb, 4, 2, 32]
        if block_type == "q5_k":
            qh = b[..., 16:48]  # bit 2i (2i + 1) of byte l: sub-block 2i (2i + 1), weight l
            bits = torch.stack([(qh >> s) & 1 for s in range(8)], dim=2)  # [n, nb, 8, 32]
            q = q | (bits.view(n, -1, 4, 2, 32) << 4)
        return {"q": q.reshape(n, -1), "d": b[..., 0:2], "dmin": b[..., 2:4], "sc": sc,
                "mn": mn}
    return _q6_k_fields(b)


def _q6_k_fields(b: Tensor) -> Fields:
    """Q6_K blocks [n, nb, 210]: ql [128], qh [64], scales int8 [16], d fp16."""
    n, nb = b.shape[0], b.shape[1]
    ql, qh = b[..., 0:128].reshape(n, nb, 2, 64), b[..., 128:192].reshape(n, nb, 2, 32)
    # Per 128-weight half: weights [0, 32) low nibbles of ql[0:32], [32, 64) of ql[32:64],
    # [64, 96) high nibbles of ql[0:32], [96, 128) of ql[32:64]; qh bits 2i, 2i + 1: piece i.
    low = torch.cat((ql[..., 0:32] & 0x0F, ql[..., 32:64] & 0x0F, ql[..., 0:32] >> 4,
                     ql[..., 32:64] >> 4), dim=-1)  # [n, nb, 2, 128]
    high = torch.cat([(qh >> (2 * i)) & 3 for i in range(4)], dim=-1)
    q = low | (high << 4)
    return {"q": q.reshape(n, -1), "d": b[..., 208:210], "sc": b[..., 192:208]}


def file_blocks(fields: Fields, block_type: str) -> Tensor:
    """`file_fields` undone: codes and fields -> the file's blocks [n, row_bytes]."""
    q = fields["q"]
    n = q.shape[0]
    if block_type in ("q4_0", "q4_1", "q8_0"):
        q32 = q.reshape(n, -1, 32)
        codes = q32 ^ 0x80 if block_type == "q8_0" else q32[..., :16] | (q32[..., 16:] << 4)
        heads = [fields["d"]] + ([fields["m"]] if block_type == "q4_1" else [])
        return torch.cat((*heads, codes), dim=-1).reshape(n, -1)
    if block_type in ("q4_k", "q5_k"):
        q5 = q.reshape(n, -1, 4, 2, 32)
        qs = (q5[:, :, :, 0] & 0x0F) | ((q5[:, :, :, 1] & 0x0F) << 4)  # [n, nb, 4, 32]
        parts = [fields["d"], fields["dmin"], _pack_kquant_scales(fields["sc"], fields["mn"])]
        if block_type == "q5_k":
            bits = (q5 >> 4).reshape(n, -1, 8, 32).to(torch.int32)
            qh = sum(bits[:, :, s] << s for s in range(8)).to(torch.uint8)
            parts.append(qh)
        return torch.cat((*parts, qs.reshape(n, -1, 128)), dim=-1).reshape(n, -1)
    q6 = q.reshape(n, -1, 2, 4, 32)  # [n, nb, half, piece, 32]
    ql = torch.cat(((q6[:, :, :, 0] & 0x0F) | ((q6[:, :, :, 2] & 0x0F) << 4),
                    (q6[:, :, :, 1] & 0x0F) | ((q6[:, :, :, 3] & 0x0F) << 4)), dim=-1)
    hi = (q6 >> 4).to(torch.int32)
    qh = sum(hi[:, :, :, i] << (2 * i) for i in range(4)).to(torch.uint8)  # [n, nb, 2, 32]
    nb = q6.shape[1]
    return torch.cat((ql.reshape(n, nb, 128), qh.reshape(n, nb, 64), fields["sc"], fields["d"]),
                     dim=-1).reshape(n, -1)
