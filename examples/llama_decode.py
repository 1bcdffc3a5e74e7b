"""A Llama-style model decoding with and without warpsplitk: accuracy and step time.

    python examples/llama_decode.py --batch 1 8 32 --json llama.json

Builds a small Llama (hidden 2048, intermediate 5632, 4 layers, 16 heads,
4 KV heads, vocab 32000) with random BF16 weights on the GPU (nothing is
downloaded), then for each batch size:

1. greedy-decodes ``--steps`` tokens with the plain model (reference), and
   feeds the same tokens to a float64 copy of the model: every path's logits
   error and top-1 agreement are also measured against it;
2. swaps the linears for ``DecodeLinear`` (``warpsplitk.patch_model``),
   replays the reference tokens through the patched model (teacher forcing,
   so every step sees the same inputs) and compares the logits; it also
   decodes freely and reports how many tokens agree;
3. times one decode step (static KV cache, CUDA graph when capture works,
   else eager with CUDA events: the output says which) for both models, and
   the model's linear layers alone at the same M, to show their share of
   the step;
4. does 2 and 3 again with ``patch_model(model, merge=True)`` (q/k/v and
   gate/up each one merged weight, one launch; the MLP's gate/up with the
   SwiGLU epilogue), after ``unpatch``.

``--fp8`` first quantizes every decoder linear (not ``lm_head``) as
transformers' ``FineGrainedFP8Config`` does on load (e4m3, one scale per
128 x 128 block: ``quantize_fp8``) into transformers' own ``FP8Linear``:
the plain model is then that FP8 model (transformers' FP8 path), the patched
one runs the FP8 kernel (W8A16), and both are measured against the float64
copy of the BF16 model.

``--config llama-3-8b --layers 4`` takes a model's sizes from
``warpsplitk.models`` instead; ``--family phi3`` (or ``--config phi-3-mini``)
builds a Phi-3, whose own ``gate_up_proj`` gets the SwiGLU epilogue. ``--device cpu --tiny`` runs the same code on a CPU (everything falls back
to F.linear) as a smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32],
                   help="batch sizes = M of the decode-step GEMMs (1..32; default 1 8 32)")
    p.add_argument("--steps", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens (default 16)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per repetition (default 20)")
    p.add_argument("--reps", type=int, default=5, help="timing repetitions, median (default 5)")
    p.add_argument("--plan", default="none",
                   help="'h200': the built-in H200 plan; 'none': the default (cost model; "
                        "the default); else a plan JSON file")
    p.add_argument("--all-ms", action="store_true",
                   help="prepare M = 1..32 (default: only the --batch sizes, fewer compiles)")
    p.add_argument("--no-graph", action="store_true", help="time eagerly, without CUDA graphs")
    p.add_argument("--tol", type=float, default=5e-2,
                   help="max relative logits error against the float64 model before "
                        "exiting 1 (default 5e-2; with --fp8 the plain FP8 model's own)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke test")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--config", metavar="MODEL",
                   help="the sizes of a grouped-query model with dense MLPs: a name of "
                        "warpsplitk.models (e.g. llama-3-8b), a config.json or a downloaded "
                        "model's id (random weights, --layers of them; default: the "
                        "small Llama above)")
    p.add_argument("--family", choices=("llama", "qwen2", "phi3"), default="llama",
                   help="the transformers model class: llama (default), qwen2 (q/k/v "
                        "biases) or phi3 (its own fused qkv_proj and [gate; up] gate_up_proj)")
    p.add_argument("--fp8", action="store_true",
                   help="the decoder's linears quantized to transformers' fine-grained FP8 "
                        "(128x128 blocks); plain = that FP8 model")
    p.add_argument("--hf-fp8-kernel", metavar="DIR",
                   help="with --fp8 where the Hub cannot be reached: a checkout of "
                        "kernels-community's finegrained-fp8, the Triton kernel transformers' "
                        "FP8Linear runs (else transformers fetches it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    bad = [b for b in args.batch if not 1 <= b <= 32]
    if bad:
        p.error(f"--batch sizes must be in 1..32, got {bad}")
    if args.steps < 1 or args.prompt_len < 1:
        p.error("--steps and --prompt-len must be >= 1")
    if args.hf_fp8_kernel is not None and not args.fp8:
        p.error("--hf-fp8-kernel: only with --fp8")
    return args


# ------------------------------------------------------------------ model


#: Models of other transformers families by their own sizes (``--config``
#: NAME): (family, sizes). ``examples/generate.py`` builds from these too.
FAMILY_CONFIGS = {
    "phi-3-mini": ("phi3", dict(hidden_size=3072, intermediate_size=8192,
                                num_attention_heads=32, num_key_value_heads=32,
                                vocab_size=32064)),
}


def build_model(args, torch, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    sizes = (dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024) if args.tiny else
             dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000))
    family = args.family
    if args.config in FAMILY_CONFIGS:
        family, sizes = FAMILY_CONFIGS[args.config][0], dict(FAMILY_CONFIGS[args.config][1])
    elif args.config:
        from warpsplitk import models
        known = models.config(args.config)  # ValueError naming the known models
        if known.get("attention") != "gqa" or "intermediate" not in known:
            what = (f"a {known.get('attention')} model" if known.get("attention") != "gqa"
                    else "every MLP a mixture of experts")
            raise ValueError(f"--config {args.config}: {what}; this example builds Llama-style "
                             "grouped-query attention and dense MLPs")
        sizes = dict(hidden_size=known["hidden"], intermediate_size=known["intermediate"],
                     num_attention_heads=known["heads"], num_key_value_heads=known["kv_heads"],
                     head_dim=known.get("head_dim", known["hidden"] // known["heads"]),
                     vocab_size=known["vocab"])
    # Phi-3's default padding token lies past a small vocabulary
    extra = {} if family == "llama" else {"pad_token_id": 0}
    config = AutoConfig.for_model(family, num_hidden_layers=args.layers,
                                  max_position_embeddings=4096, **sizes, **extra)
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device: fast, no CPU copy
        model = AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).eval(), config


#: e4m3's largest magnitude, and the scale blocks of transformers' fine-grained FP8.
E4M3_MAX = 448.0
FP8_BLOCK = 128


def quantize_fp8(torch, model, skip=("lm_head",)):
    """Every ``nn.Linear`` of ``model`` (but those named in ``skip``) replaced,
    in place, by transformers' ``FP8Linear`` holding it quantized as
    ``FineGrainedFP8Config`` quantizes on load: per 128 x 128 block, scale =
    the block's largest magnitude / 448 (``weight_scale_inv``), weight =
    e4m3 of weight / scale. Returns the qualified names replaced."""
    from torch import nn
    from transformers.integrations.finegrained_fp8 import FP8Linear
    replaced = []
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is not nn.Linear or attr in skip:
                continue
            n, k = child.weight.shape
            if n % FP8_BLOCK or k % FP8_BLOCK:
                continue  # as transformers: only whole blocks are quantized
            with torch.device("meta"):
                layer = FP8Linear(k, n, block_size=(FP8_BLOCK, FP8_BLOCK),
                                  has_bias=child.bias is not None)
            w = child.weight.detach().float()
            blocks = w.view(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
            amax = blocks.abs().amax(dim=(1, 3))
            inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
            q = (blocks / inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
            layer.weight = nn.Parameter(q.view(n, k).to(torch.float8_e4m3fn),
                                        requires_grad=False)
            layer.weight_scale_inv = nn.Parameter(inv.contiguous(), requires_grad=False)
            layer.bias = child.bias
            setattr(parent, attr, layer)
            replaced.append(f"{parent_name}.{attr}" if parent_name else attr)
    return replaced


def hf_fp8_path(torch, model, kernel_dir, device):
    """What runs transformers' FP8Linear here (its kernel from ``kernel_dir``
    when given), after one call proved it runs; raises ImportError if not."""
    from transformers.integrations.finegrained_fp8 import FP8Linear
    what = "transformers FP8Linear, its kernel as transformers loads it"
    if kernel_dir is not None:
        from warpsplitk.measure import hf_fp8
        what = hf_fp8.use_local_kernel(kernel_dir)
    layer = next(m for m in model.modules() if isinstance(m, FP8Linear))
    with torch.no_grad():
        layer(torch.randn(1, layer.in_features, device=device, dtype=torch.bfloat16))
    return f"plain model: {what}"


def load_plan(spec):
    """``--plan`` as the CLI takes it: 'h200', 'none' (None) or a plan file."""
    import warpsplitk
    if spec == "none":
        return None
    return warpsplitk.builtin_plan("h200") if spec == "h200" else warpsplitk.load_plan(spec)


def cache_name(model):
    """The KV cache's name as ``forward`` argument and output field: ``cache``
    in newer transformers, ``past_key_values`` (deprecated there) before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def greedy(torch, model, prompt, steps, forced=None):
    """Greedy decoding with a dynamic KV cache; with ``forced`` [B, steps] the
    inputs after the prompt are those tokens instead of the model's picks.
    Returns (tokens [B, steps], float32 logits [steps, B, V])."""
    name = cache_name(model)
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache, tokens, logits = getattr(out, name), [], []
    for i in range(steps):
        step_logits = out.logits[:, -1].float()
        logits.append(step_logits)
        tokens.append(step_logits.argmax(-1))
        if i + 1 == steps:
            break
        nxt = tokens[-1] if forced is None else forced[:, i]
        out = model(input_ids=nxt[:, None], **{name: cache}, use_cache=True, logits_to_keep=1)
    return torch.stack(tokens, 1), torch.stack(logits)


def compare(torch, ref_logits, logits, ref_tokens, tokens, free_tokens):
    diff = (logits - ref_logits).abs()
    match = (free_tokens == ref_tokens)
    # first step at which some sequence of the batch diverges (None: never)
    diverged = (~match).any(0).nonzero()
    return {
        "max_abs_diff": diff.max().item(),
        "rel_err": ((logits - ref_logits).norm() / ref_logits.norm()).item(),
        "top1_agree": (tokens == ref_tokens).float().mean().item(),
        "free_run_token_match": match.float().mean().item(),
        "first_divergence": int(diverged[0]) if len(diverged) else None,
    }


def package_version(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def fp64_error(torch, exact_logits, logits):
    """Relative logits error against the float64 model, and how often the
    top-1 token is the float64 model's (teacher-forced, the same inputs)."""
    exact = exact_logits.double()
    return {"rel_err_fp64": ((logits.double() - exact).norm() / exact.norm()).item(),
            "top1_agree_fp64": (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()}


def decode_counts(model):
    """Kernel and F.linear calls of the model's DecodeLinears, merged groups included."""
    from warpsplitk.nn.linear import DecodeLinear
    from warpsplitk.nn.merge import MergedPart
    mods = {id(m): m for m in model.modules() if isinstance(m, DecodeLinear)}
    for part in (m for m in model.modules() if isinstance(m, MergedPart)):
        if part.group.linear is not None:
            mods[id(part.group.linear)] = part.group.linear
    return (sum(m.kernel_calls for m in mods.values()),
            sum(m.fallback_calls for m in mods.values()))


# ----------------------------------------------------------------- timing


def time_us(torch, fn, device, graph, iters, reps):
    """Median microseconds per ``fn()`` call: (us, mode, note). With ``graph``
    the call is captured once in a CUDA graph and replayed; if capture fails
    (HF code paths that synchronise, say) it is timed eagerly and ``note`` says why."""
    if device.type != "cuda":
        fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / iters)
        return statistics.median(samples), "eager (CPU clock)", None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture wants
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    run, mode, note = fn, "eager (CUDA events)", None
    if graph:
        try:
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                fn()
            run, mode = cuda_graph.replay, "cuda-graph"
        except Exception as error:  # noqa: BLE001 - any capture failure: time eagerly instead
            note = f"CUDA graph capture failed ({type(error).__name__}: {str(error)[:200]}); timed eagerly"
            torch.cuda.synchronize()
    run()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples), mode, note


def make_decode_step(torch, model, config, batch, args, device):
    """One decode step over a static KV cache, with static input ids (capturable).
    The cache is sized for every call the timing makes, so positions never run out."""
    from transformers import StaticCache
    calls = 3 + 2 + args.iters * args.reps  # warm-up, capture + first replay, timed
    cache = StaticCache(config=config, max_cache_len=args.prompt_len + calls + 8)
    prompt = torch.randint(config.vocab_size, (batch, args.prompt_len), device=device)
    name = cache_name(model)
    with torch.no_grad():
        out = model(input_ids=prompt, **{name: cache}, use_cache=True, logits_to_keep=1)
    ids = out.logits[:, -1].argmax(-1, keepdim=True)

    def step():
        return model(input_ids=ids, **{name: cache}, use_cache=True, logits_to_keep=1).logits
    return step


def make_linear_pass(torch, model, batch, device, separated=False):
    """Every projection launch of the model (patched or not) once, at M = batch,
    back to back: what the projections cost without the rest of the step. A
    merged group is one launch (its SwiGLU epilogue included, for an MLP), as
    is an MLP's own [gate; up] projection with the epilogue. With
    ``separated``, a one-element add runs before each projection, as the
    model's own small kernels do: no projection then overlaps the one before
    (PDL); time ``separators(...)`` alone and subtract it."""
    from torch import nn
    from warpsplitk.nn.gate_up import GateUpSwiGLUMLP
    from warpsplitk.nn.linear import DecodeLinear
    from warpsplitk.nn.merge import MergedPart, SwiGLUMLP
    calls, groups, fused = [], set(), set()
    for m in model.modules():
        if isinstance(m, SwiGLUMLP) and m.group.swiglu_prepared is not None:
            groups.add(id(m.group))
            calls.append((m.group.swiglu_output, m.group.weight))
        elif isinstance(m, GateUpSwiGLUMLP) and m.prepared is not None:
            fused.add(id(m.gate_up_proj))
            calls.append((m.fused, m.gate_up_proj.weight))
    for m in model.modules():
        if isinstance(m, MergedPart) and m.group.linear is not None:
            if id(m.group) not in groups:
                groups.add(id(m.group))
                calls.append((m.group.linear, m.group.weight))
        elif isinstance(m, (nn.Linear, DecodeLinear, MergedPart)) and id(m) not in fused:
            calls.append((m, m.weight))
    # activations in the model's dtype (an FP8 weight's: BF16)
    inputs = [torch.randn(batch, w.shape[1], device=device,
                          dtype=torch.bfloat16 if w.element_size() == 1 else w.dtype)
              for _, w in calls]
    gap = torch.zeros(1, device=device)

    def run():
        for (fn, _), x in zip(calls, inputs):
            if separated:
                gap.add_(1)
            fn(x)
    run.calls = len(calls)
    return run


def separators(torch, count, device):
    """``count`` one-element adds: the part of a ``separated`` pass that is no projection."""
    gap = torch.zeros(1, device=device)

    def run():
        for _ in range(count):
            gap.add_(1)
    return run


def time_model(torch, model, config, args, device, label, notes):
    rows = {}
    for batch in args.batch:
        with torch.no_grad():
            step_us, mode, note = time_us(torch, make_decode_step(torch, model, config, batch, args,
                                                                  device),
                                          device, not args.no_graph, args.iters, args.reps)
            proj_us, proj_mode, proj_note = time_us(torch, make_linear_pass(torch, model, batch, device),
                                                    device, not args.no_graph, args.iters, args.reps)
        for n in (note, proj_note):
            if n:
                notes.append(f"{label} batch {batch}: {n}")
        rows[batch] = {"step_us": step_us, "step_timing": mode, "proj_us": proj_us,
                       "proj_timing": proj_mode, "proj_share": proj_us / step_us}
        print(f"  {label:10s} batch {batch:2d}: step {step_us:8.1f} us ({mode}), "
              f"linears alone {proj_us:8.1f} us = {100 * proj_us / step_us:5.1f}% of the step",
              flush=True)
    return rows


# ------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as error:
        print(f"error: this example needs torch and transformers ({error})", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU here (use --device cpu --tiny for a smoke test)", file=sys.stderr)
        return 2
    try:
        import warpsplitk
    except ImportError:  # run from a checkout without installing: use its src/
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        import warpsplitk
    from warpsplitk.nn.patch import patch_model, unpatch

    notes = []
    try:
        plan = load_plan(args.plan)
        model, config = build_model(args, torch, device)
    except (OSError, ValueError) as error:  # --plan unreadable; --config unknown or not Llama-style
        print(f"error: {error}", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model: {config.model_type} {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, bf16 on {gpu}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, warpsplitk {warpsplitk.__version__}")
    bf16_model = model  # the float64 reference is the BF16 model's, FP8 or not
    if args.fp8:
        model = copy.deepcopy(model)
        names = quantize_fp8(torch, model)
        print(f"quantized {len(names)} linears to transformers' fine-grained FP8 (128x128 blocks)")
        try:
            notes.append(hf_fp8_path(torch, model, args.hf_fp8_kernel, device))
        except (ImportError, ValueError, RuntimeError) as error:
            print(f"error: transformers' FP8Linear does not run here ({error}); where the Hub "
                  "cannot be reached, pass --hf-fp8-kernel DIR (a kernels-community checkout)",
                  file=sys.stderr)
            return 2

    # 1. reference decoding with the plain model
    refs = {}
    with torch.no_grad():
        for batch in args.batch:
            gen = torch.Generator(device="cpu").manual_seed(args.seed + batch)
            prompt = torch.randint(config.vocab_size, (batch, args.prompt_len), generator=gen)
            prompt = prompt.to(device)
            refs[batch] = (prompt, *greedy(torch, model, prompt, args.steps))
    # the same model in float64, fed the same tokens: what every path's error
    # is measured against (the plain BF16 model's own included)
    exact = {}
    with torch.no_grad():
        model64 = copy.deepcopy(bf16_model).to(torch.float64)
        if args.fp8:
            del bf16_model
        for batch in args.batch:
            prompt, ref_tokens, _ = refs[batch]
            exact[batch] = greedy(torch, model64, prompt, args.steps, forced=ref_tokens)[1]
        del model64
    plain_errors = {batch: fp64_error(torch, exact[batch], refs[batch][2])
                    for batch in args.batch}
    for batch, err in plain_errors.items():
        print(f"  torch batch {batch:2d} against float64: logits rel err {err['rel_err_fp64']:.2e}, "
              f"top-1 agree {err['top1_agree_fp64']:.3f}", flush=True)

    print("timing the plain model:", flush=True)
    timing = {"torch": time_model(torch, model, config, args, device, "torch", notes)}

    # 2. patch (compiles every kernel now, before any capture), check, time;
    # then again with q/k/v and gate/up merged
    ms = range(1, 33) if args.all_ms else sorted(set(args.batch))
    variants = {}
    for label, merge in (("warpsplitk", False), ("warpsplitk+merge", True)):
        t0 = time.perf_counter()
        report = patch_model(model, plan=plan, ms=ms, merge=merge)
        prep_s = time.perf_counter() - t0
        print(f"patched{' (merge=True)' if merge else ''} in {prep_s:.1f} s: {report}")
        if not report.swapped and not report.merged:
            notes.append(f"{label}: no linear was swapped or merged: the patched model is the "
                         "plain model, no speedup is reported")
        results = []
        with torch.no_grad():
            for batch in args.batch:
                prompt, ref_tokens, ref_logits = refs[batch]
                before = decode_counts(model)
                tokens, logits = greedy(torch, model, prompt, args.steps, forced=ref_tokens)
                kernel, fallback = (a - b for a, b in zip(decode_counts(model), before))
                free_tokens, _ = greedy(torch, model, prompt, args.steps)
                row = {"batch": batch, **compare(torch, ref_logits, logits, ref_tokens, tokens,
                                                 free_tokens),
                       **fp64_error(torch, exact[batch], logits),
                       "torch": plain_errors[batch],
                       "kernel_calls": kernel, "fallback_calls": fallback}
                results.append(row)
                print(f"  {label} batch {batch:2d}: against float64 rel err "
                      f"{row['rel_err_fp64']:.2e}, top-1 agree {row['top1_agree_fp64']:.3f}; "
                      f"against plain: logits rel err {row['rel_err']:.2e}, max abs "
                      f"{row['max_abs_diff']:.3g}, top-1 agree {row['top1_agree']:.3f}, "
                      f"free-run tokens agree {row['free_run_token_match']:.3f}; linear calls: "
                      f"{kernel} kernel, {fallback} F.linear (prefill and M outside the "
                      "prepared Ms)", flush=True)
        print(f"timing the model patched{' with merge=True' if merge else ''}:", flush=True)
        timing[label] = time_model(torch, model, config, args, device, label, notes)
        variants[label] = {"prepare_s": prep_s, "report": report, "results": results}
        unpatch(model)

    # 3. table
    print(f"\n{'variant':>16} {'batch':>5} {'err64 t':>9} {'err64 w':>9} {'torch us':>9} "
          f"{'wsk us':>9} "
          f"{'speedup':>7} {'lin torch':>9} {'lin wsk':>9} {'share t':>7} {'share w':>7}")
    for label, variant in variants.items():
        for row in variant["results"]:
            t, w = timing["torch"][row["batch"]], timing[label][row["batch"]]
            row.update(step_us_torch=t["step_us"], step_us_warpsplitk=w["step_us"],
                       speedup=t["step_us"] / w["step_us"], proj_us_torch=t["proj_us"],
                       proj_us_warpsplitk=w["proj_us"], proj_share_torch=t["proj_share"],
                       proj_share_warpsplitk=w["proj_share"],
                       timing=sorted({t["step_timing"], w["step_timing"]}))
            # a speedup only where the kernel ran: else the "patched" model
            # is the plain one and the ratio is timing noise
            ran = any(r["kernel_calls"] for r in variant["results"])
            if not ran:
                row["speedup"] = None
            speedup = f"{row['speedup']:7.2f}" if ran else f"{'-':>7}"
            print(f"{label:>16} {row['batch']:5d} {row['torch']['rel_err_fp64']:9.2e} "
                  f"{row['rel_err_fp64']:9.2e} {t['step_us']:9.1f} "
                  f"{w['step_us']:9.1f} {speedup} {t['proj_us']:9.1f} "
                  f"{w['proj_us']:9.1f} {100 * t['proj_share']:6.1f}% "
                  f"{100 * w['proj_share']:6.1f}%")
    for note in notes:
        print(f"note: {note}")
    # FP8 weights are the model's own error: the patched model may be no
    # further from the BF16 model's float64 copy than the plain FP8 model is
    ok = all(row["rel_err_fp64"] <= (row["torch"]["rel_err_fp64"] if args.fp8 else args.tol)
             for v in variants.values() for row in v["results"])
    bound = "the plain FP8 model's" if args.fp8 else str(args.tol)
    print("accuracy: OK" if ok else
          f"accuracy: FAILED (relative logits error against float64 above {bound})")

    if args.json:
        plain, merged = variants["warpsplitk"], variants["warpsplitk+merge"]
        data = {"config": {k: getattr(config, k) for k in (
                    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size")},
                "command": "python examples/llama_decode.py " + " ".join(
                    sys.argv[1:] if argv is None else argv),
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "args": vars(args), "device": gpu, "gpu": gpu,
                "cutlass_dsl": package_version("nvidia-cutlass-dsl"), "torch": torch.__version__,
                "transformers": transformers.__version__, "warpsplitk": warpsplitk.__version__,
                "prepare_s": plain["prepare_s"], "swapped": plain["report"].swapped,
                "skipped": [list(s) for s in plain["report"].skipped],
                "results": plain["results"],
                "merge": {"prepare_s": merged["prepare_s"], "merged": merged["report"].merged,
                          "swiglu": merged["report"].swiglu,
                          "swapped": merged["report"].swapped, "results": merged["results"]},
                "notes": notes, "accuracy_ok": ok}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
