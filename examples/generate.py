"""Hugging Face ``generate()`` with and without warpsplitk: tokens/s, eager and compiled.

    python examples/generate.py --config llama-3-8b --layers 8 --batch 1 8 32 --compile \\
        --json generate.json

Builds the model from its config with random BF16 weights on the GPU
(nothing is downloaded; ``--checkpoint PATH`` loads a local one instead),
then for each batch size greedy-decodes with transformers' own loop and a
static KV cache, the fast path transformers documents:

- plain: the model as built; patched: after ``patch_model(model, plan,
  merge=True)`` (q/k/v and gate/up each one launch, the MLP's with the SwiGLU
  epilogue, also where the model already holds one ``gate_up_proj``);
- eager: ``generate(..., disable_compile=True)``; compiled (``--compile``):
  the decode step under ``torch.compile(mode="reduce-overhead",
  fullgraph=True)`` (transformers' ``CompileConfig``), so a graph break is an
  error and each step replays CUDA graphs.

Per cell: ms per token (the difference of two generate lengths, so prefill
and set-up cancel), tokens/s (batch / ms per token), the greedy tokens'
agreement with the plain model's and, compiled, with the eager patched
model's, and the projections (each projection launch of the model once,
in a CUDA graph): chained, and separated by a small kernel as in the step,
where no projection overlaps the one before; ``bound`` is the speedup the
step would show if only its separated projections' time changed.

``--config`` is one of CONFIGS; ``--device cpu --tiny`` runs the same code on
a CPU as a smoke test (nothing runs the kernel there, and it says so).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_decode  # noqa: E402  (its projection pass and CUDA-graph timer)

#: transformers model type and sizes of each --config (random weights).
CONFIGS = {
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336,
                                 num_attention_heads=32, num_key_value_heads=8,
                                 vocab_size=128256)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944,
                                 num_attention_heads=28, num_key_value_heads=4,
                                 vocab_size=152064)),
    **llama_decode.FAMILY_CONFIGS,
}
TINY = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="llama-3-8b")
    p.add_argument("--checkpoint", help="a local model folder (from_pretrained) instead")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--compile", action="store_true", help="also time the compiled decode step")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64,
                   help="new tokens of the longer of the two timed runs (default 64)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions, median (default 3)")
    p.add_argument("--plan", default="none", help="h200, none (the default) or a plan file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the record here")
    return p.parse_args(argv)


def build_model(args, torch, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    if args.checkpoint:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16,
                                                     local_files_only=True).to(device)
        return model.eval()
    model_type, sizes = CONFIGS[args.config]
    config = AutoConfig.for_model(model_type, num_hidden_layers=args.layers,
                                  max_position_embeddings=4096, pad_token_id=0,
                                  **(TINY if args.tiny else sizes))
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device: fast, no CPU copy
        model = AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).eval()


def generate(torch, model, prompt, new_tokens, compiled):
    """Greedy tokens [B, new_tokens] from transformers' own loop, static cache."""
    from transformers import CompileConfig
    mode = (dict(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
            if compiled else dict(disable_compile=True))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, cache_implementation="static",
                             pad_token_id=0, eos_token_id=None, **mode)
    return out[:, prompt.shape[1]:]


def sample_ms(torch, model, prompt, args, compiled):
    """(ms per token, tokens of the longer run): the time of ``args.tokens``
    new tokens minus that of 8, over the difference."""
    times, tokens = [], None
    for count in (8, args.tokens):
        if prompt.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = generate(torch, model, prompt, count, compiled)
        if prompt.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) * 1e3 / (args.tokens - 8), tokens


def projections_us(torch, model, batch, device):
    """Each projection launch of the model once at M = batch, in a CUDA graph:
    ``(chained, separated)`` µs. Chained, each may overlap the one before
    (PDL); separated, each follows a small kernel, as in the model's step,
    where the other kernels never trigger it early (the separators' own time
    subtracted)."""
    def timed(run):
        with torch.no_grad():
            return llama_decode.time_us(torch, run, device, device.type == "cuda", 20, 5)[0]
    chained = timed(llama_decode.make_linear_pass(torch, model, batch, device))
    run = llama_decode.make_linear_pass(torch, model, batch, device, separated=True)
    alone = timed(llama_decode.separators(torch, run.calls, device))
    return chained, max(timed(run) - alone, 0.0)


def measure(torch, models, prompts, args, device):
    """Rows per model variant, batch and mode. The variants are timed in
    turn, ``args.reps`` rounds, the median counting: drift on the machine
    meets both alike."""
    rows = []
    for batch, prompt in prompts.items():
        proj, proj_separated = {}, {}
        for label, model in models.items():
            proj[label], proj_separated[label] = projections_us(torch, model, batch, device)
        for compiled in ((False, True) if args.compile else (False,)):
            mode = "compiled" if compiled else "eager"
            samples, tokens = {label: [] for label in models}, {}
            for model in models.values():
                generate(torch, model, prompt, args.tokens, compiled)  # warm-up (and compile)
            for _ in range(args.reps):
                for label, model in models.items():
                    ms, tokens[label] = sample_ms(torch, model, prompt, args, compiled)
                    samples[label].append(ms)
            for label in models:
                ms = statistics.median(samples[label])
                rows.append({"variant": label, "mode": mode, "batch": batch, "ms_per_token": ms,
                             "samples_ms": samples[label], "tokens_per_s": batch * 1e3 / ms,
                             "proj_us": proj[label], "proj_share": proj[label] / (ms * 1e3),
                             "proj_separated_us": proj_separated[label],
                             "tokens": tokens[label].tolist()})
                print(f"  {label:8s} {mode:8s} batch {batch:2d}: {ms:7.3f} ms/token, "
                      f"{batch * 1e3 / ms:8.1f} tokens/s, projections {proj[label]:7.1f} us "
                      f"({100 * proj[label] / (ms * 1e3):4.1f}% of a step)", flush=True)
    return rows


def agreement(a, b) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def compare(rows):
    """Speedup and token agreement of each patched cell against its plain cell
    (and, compiled, against the eager patched cell)."""
    cell = {(r["variant"], r["mode"], r["batch"]): r for r in rows}
    for (variant, mode, batch), row in cell.items():
        if mode == "compiled":  # plain's too: what compiling alone changes
            row["tokens_equal_eager"] = row["tokens"] == cell[(variant, "eager", batch)]["tokens"]
        if variant != "patched":
            continue
        plain = cell[("plain", mode, batch)]
        row["speedup"] = plain["ms_per_token"] / row["ms_per_token"]
        # the median of each round's ratio: the rounds alternate the two
        # models, so a slow spell of the host meets both samples of a round
        row["speedup_paired"] = statistics.median(
            p / q for p, q in zip(plain["samples_ms"], row["samples_ms"]))
        # what the step would gain if only its projections changed, by their
        # separated times: the speedup the projections bound
        share = plain["proj_separated_us"] / (plain["ms_per_token"] * 1e3)
        if row["proj_separated_us"] > 0 and 0 < share < 1:
            row["bound"] = 1 / (1 - share + share * row["proj_separated_us"]
                                / plain["proj_separated_us"])
        row["tokens_agree_plain"] = agreement(row["tokens"], plain["tokens"])


def print_table(rows):
    print(f"\n{'mode':>8} {'batch':>5} {'plain ms':>9} {'patched':>9} {'speedup':>9} "
          f"{'paired':>7} {'bound':>6} {'tok/s':>9} {'proj share':>10} {'agree':>6} "
          f"{'=eager':>6}")
    for row in rows:
        if row["variant"] != "patched":
            continue
        print(f"{row['mode']:>8} {row['batch']:5d} {row['ms_per_token'] * row['speedup']:9.3f} "
              f"{row['ms_per_token']:9.3f} {row['speedup']:9.3f} {row['speedup_paired']:7.3f} "
              f"{row.get('bound', 0):6.3f} "
              f"{row['tokens_per_s']:9.1f} "
              f"{100 * row['proj_share']:9.1f}% {row['tokens_agree_plain']:6.3f} "
              f"{str(row.get('tokens_equal_eager', '')):>6}")
    plain = [r for r in rows if r["variant"] == "plain" and "tokens_equal_eager" in r]
    if plain:
        print("plain model, compiled tokens equal to eager: "
              + ", ".join(f"batch {r['batch']} {r['tokens_equal_eager']}" for r in plain))


def record(args, argv, torch, model, rows, report, gpu):
    import transformers
    import warpsplitk
    for row in rows:
        row.pop("tokens")
    return {"command": "python examples/generate.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": gpu,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cutlass_dsl": llama_decode.package_version("nvidia-cutlass-dsl"),
            "warpsplitk": warpsplitk.__version__, "args": vars(args),
            "model": {k: getattr(model.config, k, None) for k in (
                "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size")},
            "patch": {"swapped": len(report.swapped), "merged": len(report.merged)},
            "rows": rows}


def main(argv=None):
    args = parse_args(argv)
    import torch
    from warpsplitk import patch_model
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU here (use --device cpu --tiny for a smoke test)", file=sys.stderr)
        return 2
    model = build_model(args, torch, device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    prompts = {b: torch.randint(model.config.vocab_size, (b, args.prompt_len),
                                generator=gen).to(device) for b in args.batch}
    print(f"{model.config.model_type}, {model.config.num_hidden_layers} layers on {gpu}")
    patched = copy.deepcopy(model)
    report = patch_model(patched, plan=llama_decode.load_plan(args.plan),
                         ms=sorted(set(args.batch)), merge=True)
    print(f"patched: {report}")
    # each variant keeps its compiled step: one graph per model and batch, static shapes
    dynamo = torch._dynamo.config
    setattr(dynamo, "recompile_limit" if hasattr(dynamo, "recompile_limit")
            else "cache_size_limit", 64)
    torch._dynamo.config.automatic_dynamic_shapes = False
    rows = measure(torch, {"plain": model, "patched": patched}, prompts, args, device)
    compare(rows)
    if (report.swapped or report.merged) and device.type == "cuda":
        print_table(rows)
    else:
        print("note: nothing here ran the warpsplitk kernel (no CUDA GPU or no linear "
              "swapped): the patched model is the plain model; no speedup is reported")
    if args.json:
        Path(args.json).write_text(json.dumps(record(args, argv, torch, model, rows, report, gpu),
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
