"""The child side of a benchmark peer: runs in the peer's own interpreter (vLLM's or
llama-cpp-python's venv), so it imports only the standard library and the peer.

`peers.PeerProcess` starts it as `python -c RUNNER peer_child.py` in an empty directory and
talks JSON lines over its stdin and stdout (everything the peer itself prints goes to
stderr: fd 1 is pointed at fd 2 before the peer is imported):

    parent -> child   {"backend": "vllm" | "llamacpp", "mode": "offline" | "latency",
                       "model": PATH, "threads": N, "prompts": [[id, ...], ...],
                       "output_lens": [n, ...], "warmup": W, "repeats": R, "options": {...}}
    child -> parent   {"event": "loaded", "info": {...}}
    latency, for each of the W + R runs:
    child -> parent   {"event": "ready", "run": i}
    parent -> child   "go"               (the parent measures bandwidth first)
    child -> parent   {"event": "run", "run": i, "token_times_s": [...], "token_ids": [...]}
    offline, after one untimed warm-up:
    child -> parent   {"event": "result", "elapsed_s": s, "outputs": [[id, ...], ...]}
    at the end        {"event": "done"}; on failure {"event": "error", "message": "..."}

Greedy, EOS ignored, every request exactly its output length. Token times are seconds since
the request was submitted, taken when the token reaches this caller (as `latency` times
our engine).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable, TextIO

Runner = Callable[[list[int], int], "tuple[list[float], list[int]]"]


def _send(out: TextIO, event: str, **fields: Any) -> None:
    out.write(json.dumps({"event": event, **fields}) + "\n")
    out.flush()


# ---- vLLM -------------------------------------------------------------------------------


def _vllm(req: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch

    torch.set_num_threads(req["threads"])  # before vLLM's CPU worker pins it
    import vllm
    from vllm import LLM

    opts = dict(req["options"])
    llm = LLM(model=req["model"], tokenizer=req["model"], seed=opts.pop("seed", 0), **opts)
    return llm, {"vllm": vllm.__version__, "torch": torch.__version__,
                 "torch_threads": torch.get_num_threads()}


def _vllm_params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    # ignore_eos alone, as ours: min_tokens would also mask EOS out of the logits.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _vllm_offline(llm: Any, prompts: list[list[int]],
                  output_lens: list[int]) -> tuple[float, list[list[int]]]:
    from vllm.inputs import TokensPrompt

    warm = [TokensPrompt(prompt_token_ids=p[:16]) for p in prompts[:2]]
    llm.generate(warm, _vllm_params(4), use_tqdm=False)
    llm.reset_prefix_cache()  # the timed run starts cold, as ours does
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [_vllm_params(n) for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def _vllm_runner(llm: Any) -> Runner:
    """One request through the engine's step loop; a token's time is that of the step
    whose output first holds it."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    counter = iter(range(1 << 62))

    def run(prompt: list[int], output_len: int) -> tuple[list[float], list[int]]:
        llm.reset_prefix_cache()  # every run pays the whole prefill
        times: list[float] = []
        ids: list[int] = []
        start = time.perf_counter()
        engine.add_request(f"latency-{next(counter)}", TokensPrompt(prompt_token_ids=prompt),
                           _vllm_params(output_len))
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter() - start
                new = list(out.outputs[0].token_ids)[len(ids):]  # cumulative outputs
                ids += new
                times += [now] * len(new)
        return times, ids

    return run


# ---- llama.cpp --------------------------------------------------------------------------


def _llamacpp(req: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import llama_cpp

    opts = req["options"]
    llm = llama_cpp.Llama(model_path=req["model"], n_ctx=opts["n_ctx"],
                          n_batch=opts["n_batch"], n_ubatch=opts["n_batch"],
                          n_threads=req["threads"], n_threads_batch=req["threads"],
                          seed=opts.get("seed", 0), verbose=False)
    info = {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    return llm, info


def _llamacpp_runner(llm: Any, n_batch: int) -> Runner:
    """llama.cpp's own decode loop (as its `simple` example): the prompt in `n_batch`
    chunks, then one token per `llama_decode`, each chosen by the greedy sampler."""
    import llama_cpp as lc

    ctx = llm._ctx.ctx
    sampler = lc.llama_sampler_init_greedy()

    def decode(tokens: list[int]) -> None:
        arr = (lc.llama_token * len(tokens))(*tokens)
        rc = lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def run(prompt: list[int], output_len: int) -> tuple[list[float], list[int]]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)  # no KV reuse between runs
        lc.llama_sampler_reset(sampler)
        times: list[float] = []
        ids: list[int] = []
        start = time.perf_counter()
        for i in range(0, len(prompt), n_batch):
            decode(prompt[i:i + n_batch])
        while True:
            token = int(lc.llama_sampler_sample(sampler, ctx, -1))
            times.append(time.perf_counter() - start)
            ids.append(token)
            if len(ids) == output_len:
                return times, ids
            decode([token])

    return run


# ---- the protocol -----------------------------------------------------------------------


def serve(req: dict[str, Any], inp: TextIO, out: TextIO) -> None:
    backend, mode = req["backend"], req["mode"]
    if (backend, mode) not in (("vllm", "offline"), ("vllm", "latency"),
                               ("llamacpp", "latency")):
        raise ValueError(f"unsupported peer backend/mode {backend}/{mode}")
    start = time.perf_counter()
    llm, info = _vllm(req) if backend == "vllm" else _llamacpp(req)
    _send(out, "loaded", info={**info, "load_s": time.perf_counter() - start})
    prompts, output_lens = req["prompts"], req["output_lens"]
    if mode == "offline":
        elapsed, outputs = _vllm_offline(llm, prompts, output_lens)
        _send(out, "result", elapsed_s=elapsed, outputs=outputs)
    else:
        run = (_vllm_runner(llm) if backend == "vllm"
               else _llamacpp_runner(llm, req["options"]["n_batch"]))
        for i in range(req["warmup"] + req["repeats"]):
            _send(out, "ready", run=i)
            if inp.readline().strip() != "go":
                raise RuntimeError("parent went away")
            times, ids = run(prompts[0], output_lens[0])
            _send(out, "run", run=i, token_times_s=times, token_ids=ids)
    _send(out, "done")


def main() -> int:
    # The protocol keeps the real stdout; the peer's prints (vLLM logs to stdout) and any
    # C library's writes to fd 1 go to stderr instead.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        serve(json.loads(sys.stdin.readline()), sys.stdin, out)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        _send(out, "error", message=f"{type(e).__name__}: {e}",
              traceback=traceback.format_exc()[-4000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
