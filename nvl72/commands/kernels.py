"""`nvl72 kernels`: build or list the ahead-of-time kernel bundle.

    nvl72 kernels build --arch sm_90a,sm_100a --out DIR   # no GPU needed; needs CuTeDSL installed
    nvl72 kernels list [--bundle DIR]                      # listed modules, and a bundle's exports
"""
from __future__ import annotations

import argparse
import os

from nvl72.cli import CLIError

HELP = "build or list the ahead-of-time kernel bundle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    b = sub.add_parser("build", help="compile every listed CuTeDSL kernel into a bundle per arch")
    b.add_argument("--arch", default="sm_90a", help="comma-separated archs (sm_90a, sm_100a); default sm_90a")
    b.add_argument("--out", required=True, help="bundle root; <out>/<arch>/ is (re)created")
    b.add_argument("--module", action="append", default=None,
                   help="only this module (repeatable); default: comms.kernels.EXPORTS + moe.kernels.EXPORTS")
    b.add_argument("--no-runtime", action="store_true",
                   help="leave out the CuTeDSL runtime, wheels and setup script (compile check only)")
    ls = sub.add_parser("list", help="the kernel modules the builder compiles, and a bundle's contents")
    ls.add_argument("--bundle", default=None, help="a bundle root or arch directory (default $NVL72_KERNEL_BUNDLE)")


def run(args: argparse.Namespace) -> int:
    import aot

    if args.action == "build":
        from aot import build
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
        bad = [a for a in archs if a not in build.ARCHS]
        if not archs or bad:
            raise CLIError(f"--arch {args.arch!r}: expected a comma-separated subset of {','.join(build.ARCHS)}")
        try:
            import cutlass.cute  # noqa: F401
        except ImportError as e:
            raise CLIError(f"building the bundle needs CuTeDSL (pip install nvidia-cutlass-dsl[cu13]): {e}") from e
        try:
            mans = build.build(args.out, archs, args.module, runtime=not args.no_runtime)
        except aot.BundleError as e:
            raise CLIError(str(e)) from e
        for man in mans:
            size = sum(man["files"].values()) / 2**20
            print(f"{os.path.join(args.out, man['arch'])}: {len(man['modules'])} modules, "
                  f"{sum(len(m['exports']) for m in man['modules'].values())} kernels, {size:.1f} MiB")
        return 0
    if args.action == "list":
        from aot import build
        for m in build.listed_modules():
            print(m)
        root = args.bundle or os.environ.get(aot.ENV_BUNDLE)
        if root:
            dirs = [root] if os.path.isfile(os.path.join(root, aot.MANIFEST)) else \
                [os.path.join(root, d) for d in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, d))]
            for d in dirs:
                try:
                    man = aot.read_manifest(d)
                except aot.BundleError as e:
                    raise CLIError(str(e)) from e
                print(f"bundle {d} (arch {man['arch']}, built {man['built']}, "
                      f"nvidia-cutlass-dsl {man['nvidia-cutlass-dsl']}):")
                for mod, info in man["modules"].items():
                    print(f"  {mod}: {', '.join(info['exports'])}")
        return 0
    raise CLIError("expected an action: build or list")
