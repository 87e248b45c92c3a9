"""The `autoshard` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoshard", description="Compile PyTorch models into distributed programs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT on local gloo ranks next to single-device training")
    demo.add_argument("--ranks", type=int, default=4, help="number of local ranks (default 4)")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from autoshard.demo import main as demo_main

        return demo_main(ranks=args.ranks, steps=args.steps)
    return 2


if __name__ == "__main__":
    sys.exit(main())
