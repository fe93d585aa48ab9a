"""The ``jaxremat`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxremat", description="Optimal rematerialisation for JAX under a budget.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan a ResNet-style chain for a few budgets against the baselines")
    demo.add_argument("--budgets", nargs="+", default=["30%", "50%", "75%"], help="budgets (bytes, '512MiB', '40%%')")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jaxremat.demo import run_demo

        try:
            run_demo(tuple(args.budgets))
        except ValueError as e:
            print(f"jaxremat: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
