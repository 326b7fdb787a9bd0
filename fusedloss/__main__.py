"""``python -m fusedloss estimate``: what fusedloss would save for a model and a batch (``fusedloss.sizing``),
and ``python -m fusedloss status``: which backends run here."""

import argparse
import json
import sys

from . import backend_status
from .sizing import DTYPES, OPS, estimate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedloss", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    est = commands.add_parser("estimate", help="the logits-sized memory and the products of one loss call: "
                              "materialised logits, TRL's chunked kernel and fusedloss")
    est.add_argument("--model-config", help="a Hugging Face config.json, or the model folder holding it")
    est.add_argument("--hidden-size", type=int, help="D, instead of (or overriding) the config's")
    est.add_argument("--vocab-size", type=int, help="V, instead of (or overriding) the config's")
    est.add_argument("--tokens", type=int, required=True, help="N, the tokens of one loss call")
    est.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    est.add_argument("--op", default="cross_entropy", choices=OPS)
    est.add_argument("--gpu", default="h200", help="whose memory sizes fusedloss's default workspace")
    est.add_argument("--workspace-mb", type=float, help="fusedloss's workspace (as FUSEDLOSS_WORKSPACE_MB)")
    commands.add_parser("status", help="which backends can run here, and why not")
    args = parser.parse_args(argv)
    if args.command == "status":
        print(json.dumps(backend_status(), indent=1))
        return 0
    if args.model_config is None and (args.hidden_size is None or args.vocab_size is None):
        parser.error("estimate needs --model-config, or both --hidden-size and --vocab-size")
    try:
        result = estimate(args.model_config, tokens=args.tokens, hidden_size=args.hidden_size,
                          vocab_size=args.vocab_size, dtype=args.dtype, op=args.op, gpu=args.gpu,
                          workspace_mb=args.workspace_mb)
    except ValueError as exc:
        parser.error(str(exc))
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
