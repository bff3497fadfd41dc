"""`attnlens serve MODEL [vLLM's serve arguments]`: vLLM's OpenAI-compatible server, its own app, arguments and
defaults (compiled model, prefix caching, chunked prefill, tensor parallelism), with attnlens's worker reducing the
rows of requests that ask for attention (attnlens/vllm/serving.py) and the `Attention` middleware answering them.
"""

from __future__ import annotations

import os

from .middleware import MAX_VALUES, MAX_VALUES_ENV

MIDDLEWARE = "attnlens.serve.middleware.Attention"
#: Seconds a SIGTERM waits for the requests in flight to finish (`--shutdown-timeout`, unless given).
DRAIN_S = 30


def arguments(model: str, argv: list[str], name: str | None = None):
    """vLLM's parsed serve arguments for `model` (a folder) and `argv`, with attnlens's worker, engine settings and
    middleware; `--attention-max-values` is attnlens's own (the most values one request may ask for). `name`, a
    bundled checkpoint's, is the model's name in requests unless `--served-model-name` gives one."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ..vllm import serving, worker
    from ..vllm.model import COMPILED_KEY, engine_settings

    parser = make_arg_parser(FlexibleArgumentParser(prog="attnlens serve"))
    parser.add_argument(
        "--attention-max-values",
        type=int,
        default=MAX_VALUES,
        help=f"the most values (layers x heads x rows x width) one request may ask for (default {MAX_VALUES})",
    )
    args = parser.parse_args(["--model", model, *argv])
    if name and not args.served_model_name:
        args.served_model_name = [name]
    if not any(arg.startswith("--shutdown-timeout") for arg in argv):
        args.shutdown_timeout = DRAIN_S  # vLLM's default (0) aborts the requests in flight at SIGTERM
    settings = {"additional_config": args.additional_config or {}, "model_impl": args.model_impl}
    if args.hf_overrides:
        settings["hf_overrides"] = args.hf_overrides
    if args.attention_backend:
        settings["attention_backend"] = args.attention_backend
    engine_settings(model, None, settings)
    args.additional_config = {
        **settings["additional_config"],
        COMPILED_KEY: not args.enforce_eager,
        serving.CONFIG_KEY: True,
    }
    args.hf_overrides = settings.get("hf_overrides", args.hf_overrides)
    args.attention_backend = settings.get("attention_backend", args.attention_backend)
    args.worker_cls = worker.WORKER_GPU if worker.has_accelerator() else worker.WORKER_CPU
    args.middleware = [*(args.middleware or []), MIDDLEWARE]
    validate_parsed_serve_args(args)
    return args


def main(model: str, argv: list[str], name: str | None = None) -> None:
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    args = arguments(model, argv, name)
    os.environ[MAX_VALUES_ENV] = str(args.attention_max_values)  # for the API server processes
    uvloop.run(run_server(args))
