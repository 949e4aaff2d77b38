"""`nvl72 plan`: print the deployment of prefill and decode instances for a rack, a model and token rates."""
from __future__ import annotations

import argparse
import pathlib

from nvl72.cli import CLIError

HELP = "print the deployment of prefill and decode instances for a rack, a model and token rates"


def add_plan_arguments(parser: argparse.ArgumentParser, rack_default: str | None) -> None:
    """The plan's inputs; shared with `nvl72 launch`, which computes the same plan on every rank."""
    parser.add_argument("--rack", default=rack_default,
                        help="nvl72 | hgx-h100 | hgx-h200 | hgx-b200 | cpu:N | cpu:NODESxN | a rack YAML file"
                             + (f" (default {rack_default})" if rack_default else ""))
    parser.add_argument("--model", help="built-in name (e.g. Qwen3-235B-A22B), config.json or checkpoint directory")
    parser.add_argument("--input-tps", type=float, default=0.0, help="prompt tokens per second to serve")
    parser.add_argument("--output-tps", type=float, default=0.0, help="generated tokens per second to serve")
    parser.add_argument("--decode-batch-threshold", type=int, default=128,
                        help="largest batch a decode rank may run (default 128)")
    parser.add_argument("--prompt-len", type=int, default=4096, help="mean prompt tokens per request (default 4096)")
    parser.add_argument("--output-len", type=int, default=1024, help="mean output tokens per request (default 1024)")
    parser.add_argument("--prefill-tp", type=int, help="ranks per prefill instance (default: a node, at most 4)")
    parser.add_argument("--decode-size", type=int, help="ranks per decode instance (default 16, within one NVLink domain)")
    parser.add_argument("--decode-tp", type=int, default=1, help="attention TP inside a decode instance (default 1)")
    parser.add_argument("--prefill-instances", type=int, help="fix the number of prefill instances")
    parser.add_argument("--decode-instances", type=int, help="fix the number of decode instances")


def plan_from_args(args: argparse.Namespace, rack=None):
    """Build the plan from parsed arguments (`rack` overrides --rack, e.g. the launch's own rack)."""
    from nvl72.plan import PlanError, Workload, load_model, make_plan
    from nvl72.topology import TopologyError, load_rack

    if not args.model:
        raise CLIError("--model is required")
    try:
        rack = rack or load_rack(args.rack)
        model = load_model(args.model)
        w = Workload(args.input_tps, args.output_tps, args.prompt_len, args.output_len, args.decode_batch_threshold)
        return make_plan(rack, model, w, args.prefill_tp, args.decode_size, args.decode_tp,
                         args.prefill_instances, args.decode_instances)
    except (PlanError, TopologyError) as e:
        raise CLIError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser, rack_default="nvl72")
    parser.add_argument("--out", help="also write the plan as JSON here (input of `nvl72 launch --plan`)")
    parser.add_argument("--measure-constants", metavar="FILE",
                        help="instead of planning, measure this GPU's hardware figures and write them as "
                             "plan_constants.json entries to FILE")


def run(args: argparse.Namespace) -> int:
    if args.measure_constants:
        import json
        import sys

        from nvl72.plan import PlanError, measure_constants

        try:
            data = measure_constants("nvl72 " + " ".join(sys.argv[1:]))
        except PlanError as e:
            raise CLIError(str(e)) from None
        pathlib.Path(args.measure_constants).write_text(json.dumps(data, indent=1))
        print(json.dumps(data, indent=1))
        return 0
    plan = plan_from_args(args)
    print(f"nvl72 plan: {plan.model} on {plan.rack.name}")
    print("\n".join(plan.explanation))
    print("layout:")
    print("\n".join(plan.layout()))
    if args.out:
        pathlib.Path(args.out).write_text(plan.to_json())
        print(f"plan written to {args.out}")
    return 0
