"""The `musespark` command line.

    musespark generate [--model DIR] [--max-tokens N] [--temperature T] [--top-p P]
                       [--seed S] [--chat [--tools JSON] [--run-tools DIR] [--chat-template FILE]
                       [--chat-template-kwargs JSON]]
                       PROMPT...

    musespark serve [MODEL] [--host H] [--port P] [--api-key KEY...] [--served-model-name NAME...]
                    [--chat-template FILE] [--default-chat-template-kwargs JSON]
                    [--reasoning-effort-map JSON] [any other `vllm serve` flag] ...

    musespark bench latency|throughput [--model DIR | --preset NAME] [--dtype D] ...
    musespark bench serve [--base-url URL] [--num-prompts N] [--request-rate R] ...

    musespark plan [--model DIR | --preset NAME] [-tp N] [-ep] [-pp N] [--quantization nvfp4]
                   [--dtype D] [--device-memory GB] [--json]

`generate` prints each completion as it streams (generate_cli.py); `serve` runs the
OpenAI-compatible HTTP server with vLLM's flag names (serve_cli.py, musespark.server.vllm_flags).
Without a model both use the bundled model. `bench` runs vLLM's three benchmark modes (see
musespark.bench); its last output line is one JSON object. `plan` is plan_cli.py; `quantize`
is here.

The engine flags (--model, --dtype, --backend, --max-model-len, ...) of generate, serve and
bench latency/throughput come from `EngineArgs.add_cli_args`: one table of names and
defaults. `generate --seed` is the per-request sampling seed (the engine seed elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import generate_cli, plan_cli, serve_cli
from .cli_parsing import MuseParser


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from .bench import latency, serve, throughput

    p = sub.add_parser("bench", help="benchmark: latency | throughput (offline engine) | serve (a running server)")
    modes = p.add_subparsers(dest="bench_mode", required=True)
    latency.add_args(modes.add_parser("latency", help="one batch: prefill and per-token decode times"))
    throughput.add_args(modes.add_parser("throughput", help="N seeded random requests through the offline engine"))
    serve.add_args(modes.add_parser("serve", help="drive a running `musespark serve` (TTFT, TPOT, ITL, E2EL)"))


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import latency, serve, throughput

    return {"latency": latency.main, "throughput": throughput.main, "serve": serve.main}[args.bench_mode](args)


def _quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write an NVFP4 (ModelOpt-format) copy of a bf16 checkpoint")
    p.add_argument(
        "--format",
        required=True,
        choices=["nvfp4"],
        help="the quantized format (NVFP4: E2M1 codes, "
        "fp8-e4m3 block scales per 16, fp32 global and calibrated input scales)",
    )
    p.add_argument("src", metavar="SRC", help="the unquantized checkpoint directory")
    p.add_argument("dst", metavar="DST", help="the new checkpoint directory (must not exist or be empty)")
    p.add_argument(
        "--scope",
        default="experts",
        choices=["experts", "linear"],
        help="experts (default): routed experts of every layer but the first and last; "
        "linear: every linear layer and all experts, not the LM head",
    )
    p.add_argument(
        "--calibration-prompts",
        type=int,
        default=16,
        metavar="N",
        help="prompts the bf16 model runs to calibrate the activation input scales (default 16)",
    )
    p.add_argument(
        "--calibration-file",
        default=None,
        metavar="F",
        help="a text file whose blank-line-separated paragraphs are the calibration prompts "
        "(default: modules of the Python standard library, the bundled model's corpus)",
    )


def _run_quantize(args: argparse.Namespace) -> int:
    from .apps.quantize import quantize_checkpoint

    quantize_checkpoint(
        args.src,
        args.dst,
        scope=args.scope,
        calibration_prompts=args.calibration_prompts,
        calibration_file=args.calibration_file,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = MuseParser(prog="musespark", description="Serve and run Muse Spark 1x models.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    _bench_parser(sub)
    plan_cli.add_parser(sub)
    _quantize_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return generate_cli.run(args)
        if args.command == "serve":
            return serve_cli.run(args)
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "plan":
            return plan_cli.run(args)
        if args.command == "quantize":
            return _run_quantize(args)
    except ValueError as exc:
        print(f"musespark {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: stop quietly, with the shell's status for SIGINT (no traceback)
        print(file=sys.stderr, flush=True)  # end the line the interrupted output left open
        if args.command == "serve":  # as uvicorn does once it has shut down: die of the signal itself
            import atexit
            import os
            import signal

            atexit._run_exitfuncs()  # what a normal exit runs first (the -tp workers' clean stop)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
