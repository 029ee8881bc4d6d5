"""What speculative decoding needs of the target model: several tokens of one request
verified in one forward, each its own decode row (query_len 1, its own position and seq_len,
the request's block table), on the fused C decode (kernels/cpu/llama_decode.c) and on the
layer path; and EAGLE-3's auxiliary hidden states (LlamaForCausalLM.aux_hidden_state_layers)
against transformers' output_hidden_states."""
from __future__ import annotations

import random

import pytest
import torch
from tiny_models import TINY_ARCHS, make_tiny_model_dir

from aioengine.kernels import cpu as cpu_kernels
from aioengine.model.attention import TorchAttentionBackend, build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model

CPU = torch.device("cpu")
BLOCK_SIZE = 4
VOCAB = 49152
# Storage -> (dtype, tolerance), as in test_fused_decode.py: the fused and layer paths do
# the same arithmetic up to summation order; bf16 rounds each projection's output.
STORAGES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 3e-2)}
# 1 thread: the fused kernel's one-row-per-thread path; 8 (more threads than rows): each
# row's context split across the threads; 2: either, by the number of rows.
THREADS = [1, 2, 8]
# Requests as (context length, rows): 4 rows of one request, and 2 requests x 3 rows; the
# rows cross block boundaries (block size 4), so some read a block another row writes.
# "part": rows on both sides of the attention's first part boundary (256 positions: the
# first two rows attend one part, the others two), beside a short request.
CASES = {"1x4": [(6, 4)], "2x3": [(3, 3), (10, 3)], "part": [(5, 2), (254, 5)]}


@pytest.fixture(scope="module", params=[(a, s) for a in TINY_ARCHS for s in STORAGES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request, tiny_model_dirs):
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    arch, storage = request.param
    dtype, tol = STORAGES[storage]
    loaded = load_model(str(tiny_model_dirs[arch]), dtype, CPU).model
    loaded.test_tolerance = tol
    return loaded


@pytest.fixture(params=THREADS, ids=lambda n: f"threads{n}")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


class SpecStep:
    """Requests whose prompts (their contexts) are in the KV caches, computed layer by layer
    in an earlier step, and the next tokens of each to run in one step."""

    def __init__(self, model, requests: list[tuple[int, int]], seed: int = 0) -> None:
        rng = random.Random(seed)
        self.requests = requests
        num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in requests) + 4
        self.caches = make_kv_caches(model.arch, num_blocks, BLOCK_SIZE, torch.float32, CPU)
        free = list(range(num_blocks))
        rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK_SIZE))]
                       for c, n in requests]
        self.tokens = [[rng.randrange(3, VOCAB) for _ in range(c + n)] for c, n in requests]
        # forward's result for the contexts (those not empty), in one prefill step.
        self.prompt_out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
        context = [(c, table, toks[:c]) for (c, _), table, toks in
                   zip(requests, self.tables, self.tokens) if c > 0]
        if context:
            with torch.inference_mode():
                meta, positions = build_attention_metadata(
                    [c for c, _, _ in context], [c for c, _, _ in context],
                    [table for _, table, _ in context], BLOCK_SIZE, CPU)
                self.prompt_out = model(torch.tensor([t for _, _, p in context for t in p]),
                                        positions, self.caches, meta)

    def new_tokens(self) -> torch.Tensor:
        return torch.tensor([t for (c, _), toks in zip(self.requests, self.tokens)
                             for t in toks[c:]])

    def run_rows(self, model, fused: bool):
        """The new tokens as decode rows: row j of a request at position c + j, seq_len
        c + j + 1, the request's block table. Returns (forward's result, caches after)."""
        seq_lens = [c + j + 1 for c, n in self.requests for j in range(n)]
        tables = [table for (_, n), table in zip(self.requests, self.tables) for _ in range(n)]
        meta, positions = build_attention_metadata([1] * len(seq_lens), seq_lens, tables,
                                                   BLOCK_SIZE, CPU)
        assert meta.num_decodes == meta.num_reqs == len(seq_lens)
        assert positions.tolist() == [n - 1 for n in seq_lens]
        return self._run(model, fused, positions, meta)

    def run_one_by_one(self, model) -> torch.Tensor:
        """The new tokens as plain decode steps, row j of every request in step j, on the
        fused path; the rows' outputs in run_rows' order."""
        caches = [c.clone() for c in self.caches]
        outs: dict[tuple[int, int], torch.Tensor] = {}
        for j in range(max(n for _, n in self.requests)):
            rows = [r for r, (_, n) in enumerate(self.requests) if j < n]
            seq_lens = [self.requests[r][0] + j + 1 for r in rows]
            meta, positions = build_attention_metadata(
                [1] * len(rows), seq_lens, [self.tables[r] for r in rows], BLOCK_SIZE, CPU)
            ids = torch.tensor([self.tokens[r][self.requests[r][0] + j] for r in rows])
            with torch.inference_mode():
                out = model(ids, positions, caches, meta)
            for i, r in enumerate(rows):
                outs[r, j] = out[i]
        return torch.stack([outs[r, j] for r, (_, n) in enumerate(self.requests)
                            for j in range(n)])

    def run_chunks(self, model):
        """The new tokens as one prefill chunk per request (query_len = rows)."""
        meta, positions = build_attention_metadata(
            [n for _, n in self.requests], [c + n for c, n in self.requests], self.tables,
            BLOCK_SIZE, CPU)
        return self._run(model, False, positions, meta)

    def _run(self, model, fused: bool, positions, meta):
        caches = [c.clone() for c in self.caches]
        model.use_fused_decode = fused
        try:
            with torch.inference_mode():
                out = model(self.new_tokens(), positions, caches, meta)
        finally:
            model.use_fused_decode = True
        return out, caches


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rows_of_one_request_match_the_layer_path_and_a_chunk(model, case: str, threads: int,
                                                              fused_calls) -> None:
    """Each row attends over the slots the rows before it write in the same step: every
    layer must write all rows' K/V before any row attends. The fused kernel's hidden states
    and caches equal the layer path's (decode attention in C, and SDPA), and those of the
    same tokens as prefill chunks."""
    step = SpecStep(model, CASES[case])
    num_rows = sum(n for _, n in CASES[case])
    tol = model.test_tolerance
    for _ in range(3):  # a race shows up only sometimes
        fused, fused_caches = step.run_rows(model, fused=True)
        layer, layer_caches = step.run_rows(model, fused=False)
        chunk, chunk_caches = step.run_chunks(model)
        torch.testing.assert_close(fused, layer, atol=tol, rtol=tol)
        torch.testing.assert_close(fused, chunk, atol=tol, rtol=tol)
        for a, b, c in zip(fused_caches, layer_caches, chunk_caches):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
            torch.testing.assert_close(a, c, atol=tol, rtol=tol)
    assert fused_calls == [num_rows] * 3  # the rows took the fused path, the rest did not
    backend = model.attn_backend
    model.attn_backend = TorchAttentionBackend(use_cpu_kernel=False)  # SDPA decode
    try:
        sdpa, _ = step.run_rows(model, fused=True)
    finally:
        model.attn_backend = backend
    assert fused_calls == [num_rows] * 3
    torch.testing.assert_close(sdpa, fused, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rows_of_one_request_have_the_bits_of_plain_decode_steps(model, case: str,
                                                                 threads: int) -> None:
    """The fused kernel attends a request's rows together (each position's K/V read once
    for all of them): each row keeps the bits it has when decoded alone, step by step, so
    greedy verification keeps plain decoding's tokens."""
    step = SpecStep(model, CASES[case])
    fused, _ = step.run_rows(model, fused=True)
    assert torch.equal(fused, step.run_one_by_one(model))


# ---- auxiliary hidden states (EAGLE-3) --------------------------------------------------

NUM_LAYERS = 4
# Out of order, a repeat, the embeddings (0) and the last layer's input.
AUX_LAYERS = (2, 0, 3, 2)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def four_layer_models(request, tmp_path_factory, bundled_tokenizer):
    """(ours float32, ours bf16, transformers) of a 4-layer tiny model."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(request.param, tmp_path_factory.mktemp(request.param),
                               tokenizer=bundled_tokenizer, num_hidden_layers=NUM_LAYERS)
    ours = load_model(str(path), torch.float32, CPU).model
    ours16 = load_model(str(path), torch.bfloat16, CPU).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for m in (ours, ours16):
        m.aux_hidden_state_layers = AUX_LAYERS
    yield ours, ours16, hf
    for m in (ours, ours16):
        m.aux_hidden_state_layers = ()


@torch.inference_mode()
def _hf_aux(hf, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed hidden states, AUX_LAYERS' entries of output_hidden_states side by
    side) of transformers at every position."""
    out = hf.model(torch.tensor([token_ids]), output_hidden_states=True, use_cache=False)
    states = out.hidden_states
    assert len(states) == NUM_LAYERS + 1  # the embeddings, each layer's output
    return out.last_hidden_state[0], torch.cat([states[i][0] for i in AUX_LAYERS], dim=-1)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_aux_hidden_states_match_transformers(four_layer_models, case: str,
                                              threads: int, fused_calls) -> None:
    """The residual stream into each listed layer, of the prompts (prefill, layer path) and
    of decode rows (fused and layer path), as transformers' output_hidden_states."""
    ours, _, hf = four_layer_models
    step = SpecStep(ours, CASES[case])
    hidden_size = ours.arch.hidden_size
    ref = [_hf_aux(hf, toks) for toks in step.tokens]
    assert isinstance(step.prompt_out, tuple)
    prompt_hidden, prompt_aux = step.prompt_out
    assert prompt_aux.dtype == torch.float32
    assert prompt_aux.shape == (sum(c for c, _ in CASES[case]), len(AUX_LAYERS) * hidden_size)
    atol, rtol = 1e-4, 1e-5  # fp32 on both sides, as test_llama_vs_hf.py
    torch.testing.assert_close(
        prompt_hidden, torch.cat([h[:c] for (c, _), (h, _) in zip(CASES[case], ref)]),
        atol=atol, rtol=rtol)
    torch.testing.assert_close(
        prompt_aux, torch.cat([aux[:c] for (c, _), (_, aux) in zip(CASES[case], ref)]),
        atol=atol, rtol=rtol)
    ref_hidden = torch.cat([h[c:] for (c, _), (h, _) in zip(CASES[case], ref)])
    ref_aux = torch.cat([aux[c:] for (c, _), (_, aux) in zip(CASES[case], ref)])
    for fused in (True, False):
        (hidden, aux), _ = step.run_rows(ours, fused)
        torch.testing.assert_close(hidden, ref_hidden, atol=atol, rtol=rtol)
        torch.testing.assert_close(aux, ref_aux, atol=atol, rtol=rtol)
    assert fused_calls == [sum(n for _, n in CASES[case])]


@pytest.mark.parametrize("seq_lens", [[1], [9], [4, 17, 6]])
def test_fused_aux_matches_the_layer_path_bf16(four_layer_models, seq_lens: list[int],
                                               threads: int, fused_calls) -> None:
    """bf16 weights (no transformers counterpart here): the fused kernel's aux hidden states
    as the layer path's, for one decode token per request."""
    _, ours, _ = four_layer_models
    step = SpecStep(ours, [(n - 1, 1) for n in seq_lens])
    (hidden, aux), _ = step.run_rows(ours, fused=True)
    (ref_hidden, ref_aux), _ = step.run_rows(ours, fused=False)
    assert fused_calls == [len(seq_lens)]
    torch.testing.assert_close(hidden, ref_hidden, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(aux, ref_aux, atol=3e-2, rtol=3e-2)
    # The embeddings (layer 0, the second listed) go through unchanged.
    h = ours.arch.hidden_size
    assert torch.equal(aux[:, h:2 * h], ref_aux[:, h:2 * h])


def test_no_aux_layers_returns_the_hidden_states_alone(four_layer_models) -> None:
    ours, _, _ = four_layer_models
    ours.aux_hidden_state_layers = ()
    try:
        step = SpecStep(ours, [(5, 1), (3, 2)])
        assert isinstance(step.prompt_out, torch.Tensor)
        for fused in (True, False):
            out, _ = step.run_rows(ours, fused)
            assert isinstance(out, torch.Tensor) and out.shape == (3, ours.arch.hidden_size)
    finally:
        ours.aux_hidden_state_layers = AUX_LAYERS


@pytest.mark.parametrize("bad", [(NUM_LAYERS,), (-1,)])
def test_aux_layers_out_of_range_are_rejected(four_layer_models, bad) -> None:
    ours, _, _ = four_layer_models
    ours.aux_hidden_state_layers = bad
    try:
        with pytest.raises(ValueError, match="aux_hidden_state_layers"):
            SpecStep(ours, [(5, 1)])
    finally:
        ours.aux_hidden_state_layers = AUX_LAYERS
