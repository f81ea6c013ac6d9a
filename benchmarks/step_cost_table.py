"""`benchmarks/step_cost.py`'s table: each strategy's measured step against the causal step, the ratio its method
predicts (`expected`: fwd = 1 unit, bwd = 2), the planner's FLOPs ratio and, on a GPU with a known peak, MFU."""

from __future__ import annotations

from strategies.assembly import strategy_class
from strategies.options import resolve_options


def expected(spec, name: str) -> tuple[float, str]:
    """The ratio a strategy's method predicts against the causal step, fwd = 1 unit and bwd = 2, and why."""
    if name == "mdlm":
        return 1.0, "one fwd+bwd, same shape"
    if name == "scdd":
        return 1.0, "one fwd+bwd; + vocab-sized loss terms at every position (mask + uniform channels)"
    if name == "hybrid":
        return 2.0, "two fwd+bwd: diffusion + causal branch"
    if name == "idlm":
        return 2.0, "one fwd+bwd over 2L under its mask (linear parts 2x, attention more)"
    if name == "block_diffusion":
        return 7 / 3, "encoder fwd+bwd + canvas fwd+bwd + no-grad canvas fwd (self-conditioning)"
    if strategy_class(name).trains == "draft":
        options = resolve_options(spec, name)
        blocks = getattr(options, "num_blocks_per_sample", 1) * options.block_size
        share = (
            spec.model.num_layers
            * min(blocks, spec.data.seq_len)
            / (spec.dflash.pretrain.num_layers * spec.data.seq_len)
        )
        return share, "draft layers x block positions / target layers x L (+ the target's head)"
    return float("nan"), "no model of its method here"


def print_table(spec_of: dict, results: dict, args, peak: float | None) -> None:
    tokens = args.seq * args.batch
    head = (
        "| strategy | step ms | causal ms | measured | expected (method) | FLOPs ratio | measured ÷ FLOPs "
        "| ÷ FLOPs, causal attention at ½ | causal GFLOP/s |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|"
    if peak:
        head, rule = head + " MFU (6·N·tok/s) | counted-FLOPs util |", rule + "---|---|"
    print("\n" + head + "\n" + rule)
    notes = []
    nan = float("nan")
    for name, r in results.items():
        exp, why = expected(spec_of[name], name)
        notes.append(f"- {name}: expected {exp:.2f}: {why}")
        flops = r.get("flops", nan) / r.get("causal_flops", nan)
        halved = flops * (1 - r.get("flops_causal_share", nan) / 2) / (1 - r.get("causal_causal_share", nan) / 2)
        rate = r.get("causal_flops", nan) / r["causal"] / 1e6  # FLOPs per ms → GFLOP/s
        line = (
            f"| {name} | {r['strategy']:.1f} | {r['causal']:.1f} | {r['ratio']:.2f} | {exp:.2f} | {flops:.2f} "
            f"| {r['ratio'] / flops:.2f} | {r['ratio'] / halved:.2f} | {rate:,.1f} |"
        )
        if peak:
            seconds = r["strategy"] / 1000
            mfu = 6 * r["params"] * tokens / seconds / (peak * 1e12)
            util = r.get("flops", float("nan")) / seconds / (peak * 1e12)
            line += f" {mfu:.1%} | {util:.1%} |"
        print(line)
    print("\n" + "\n".join(notes))
    if args.explain:
        from step_cost_explain import print_explain

        print_explain(results)
