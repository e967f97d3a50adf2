r"""Serve a model with JetStream's own orchestrator over gRPC (evaluation, interactive use).

  python -m dvp_jax.serve.server --random_init_preset=tiny --port=9000
  python -m dvp_jax.serve.server --hf_checkpoint=/models/qwen3-0.6b \
      --tokenizer=/models/qwen3-0.6b --max_prefill_length=1024 --max_decode_length=1024

JetStream's `Driver` runs a `jetstream.JetStreamEngine` as both its prefill and generate engine
(interleaved) and its `LLMOrchestrator` answers `Decode` and `HealthCheck`, on a gRPC server
bound to `--host` (127.0.0.1 by default; JetStream's `server_lib.run` binds every interface).
Malformed requests get INVALID_ARGUMENT before they reach the orchestrator, whose threads
SIGKILL the process on any exception (`validation_error`). A `--host:--port` that cannot be
bound stops the process before the model loads: one line on stderr naming the address and why,
exit status 2. SIGTERM / SIGINT stop the server and the driver (exit 0). Weights come from
exactly one of the checkpoint flags (`build_engine`); engine flags take `EngineConfig`'s names
and defaults.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket

import grpc
import jax
from absl import app, flags
from flax import nnx
from google.protobuf.message import DecodeError

# First: JetStream 0.2.2 needs `jax.tree_map` and a `seqio` module before it is imported.
from dvp_jax.serve import jetstream_compat  # noqa: F401

# isort: split
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from dvp_jax.cli import (
    COMPILATION_CACHE_HELP,
    DEFAULT_COMPILATION_CACHE,
    USAGE_EXIT_CODE,
    fail,
    parse_flags,
    use_compilation_cache,
)
from dvp_jax.errors import UserError, one_line
from dvp_jax.model.config import PRECISIONS, DTypePolicy, ModelConfig
from dvp_jax.rollout import loading
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.state import DECODE_ATTENTION
from dvp_jax.serve.jetstream import JetStreamEngine
from dvp_jax.sharding import (
    ROLLOUT_RULES,
    MeshConfig,
    Sharder,
    make_mesh,
)
from dvp_jax.tokenizer_api import DEFAULT_PREFILL_LENGTHS

_log = logging.getLogger(__name__)


def _orchestrator():
    """JetStream's orchestrator module, imported on first use.

    Importing it adds a DEBUG handler on stdout to the root logger (besides absl's, which
    already prints every record): that handler is removed again, so each line is printed once,
    and the root level is left to `main`.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from jetstream.core import orchestrator

    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    return orchestrator


def make_driver(engine: JetStreamEngine):
    """JetStream's driver of one engine doing both prefill and generate (interleaved)."""
    return _orchestrator().Driver(
        prefill_engines=[engine],
        generate_engines=[engine],
        prefill_params=[engine.params],
        generate_params=[engine.params],
        interleaved_mode=True,
    )


FLAGS = flags.FLAGS
_ENGINE = EngineConfig()  # the engine flags' defaults
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (e.g. 0.0.0.0 for all IPv4).")
flags.DEFINE_integer("port", 9000, "gRPC port.")
flags.DEFINE_string("hf_checkpoint", None, "Hugging Face Qwen3 model directory.")
flags.DEFINE_string("orbax_checkpoint", None, "Orbax StandardCheckpointer dir of nnx.State.")
flags.DEFINE_string("trainer_checkpoint", None, "A dvp_jax.main workdir (latest checkpoint).")
flags.DEFINE_string("model_preset", None, "ModelConfig preset for --orbax_checkpoint.")
flags.DEFINE_string("model_config", None, "HF config.json for --orbax_checkpoint.")
flags.DEFINE_string("random_init_preset", None, "Random weights of this ModelConfig preset.")
flags.DEFINE_string("tokenizer", "char", "'char' or a local tokenizer.json file/directory.")
flags.DEFINE_enum("dtype", _ENGINE.dtype, list(PRECISIONS), "Rollout precision.")
flags.DEFINE_float("noise_std", _ENGINE.noise_std, "Gaussian logit noise before pruning (0: off).")
flags.DEFINE_integer("max_concurrent_decodes", _ENGINE.max_concurrent_decodes, "Decode slots.")
flags.DEFINE_integer(
    "max_prefill_length",
    _ENGINE.max_prefill_length,
    "Longest prompt (BOS included); a power of 2 >= 16.",
)
flags.DEFINE_integer(
    "max_decode_length", _ENGINE.max_decode_length, "Most generated tokens per request."
)
flags.DEFINE_float("temperature", _ENGINE.temperature, "Sampling temperature.")
flags.DEFINE_float("log_rho", _ENGINE.log_rho, "log min-p threshold; -inf: no pruning.")
flags.DEFINE_bool("greedy", _ENGINE.greedy, "Greedy decoding.")
flags.DEFINE_integer("seed", _ENGINE.seed, "Base seed of the per-request keys.")
flags.DEFINE_enum(
    "decode_attention",
    _ENGINE.decode_attention,
    list(DECODE_ATTENTION),
    "Decode attention: paged (kernel on TPU, ragged XLA elsewhere), paged_xla or dense.",
)
flags.DEFINE_integer("page_size", _ENGINE.page_size, "Positions per KV page (paged decode).")
flags.DEFINE_integer(
    "kv_pages",
    _ENGINE.kv_pages,
    "Pages in the KV pool (paged decode); unset: every slot at full length. Fewer admit more "
    "requests than full-length slots: a request waits for pages when the pool is short.",
)
# The flags above that are `EngineConfig` fields, under the fields' names.
_ENGINE_FLAGS = (
    "dtype",
    "noise_std",
    "max_concurrent_decodes",
    "max_prefill_length",
    "max_decode_length",
    "temperature",
    "log_rho",
    "greedy",
    "seed",
    "decode_attention",
    "page_size",
    "kv_pages",
)
# Top-k / top-p truncation before min-p (E13, rollout/sampling.py); off by default.
flags.DEFINE_integer("top_k", _ENGINE.top_k, "Keep the top_k highest tokens (0: off).")
flags.DEFINE_float("top_p", _ENGINE.top_p, "Keep the smallest top set of mass >= top_p (1: off).")
flags.DEFINE_integer("max_kept", _ENGINE.max_kept, "Most tokens a top-k / top-p set keeps.")
_ENGINE_FLAGS += ("top_k", "top_p", "max_kept")
flags.DEFINE_integer("tensor_parallel", 1, "Devices on the mesh's tensor axis.")
flags.DEFINE_bool(
    "verbose", False, "JetStream's per-step DEBUG logging; tracebacks for every error."
)
flags.DEFINE_string("compilation_cache", DEFAULT_COMPILATION_CACHE, COMPILATION_CACHE_HELP)


# ----------------------------------------------------------------------------------------------
# Request validation.
# ----------------------------------------------------------------------------------------------
class _Unparsable:
    """Stands in for a request whose bytes are not a valid DecodeRequest (e.g. non-UTF-8 text)."""

    def __init__(self, reason: str):
        self.reason = reason


def _parse_decode_request(data: bytes):
    try:
        return jetstream_pb2.DecodeRequest.FromString(data)
    except DecodeError as e:
        return _Unparsable(f"malformed DecodeRequest ({e}); text must be valid UTF-8")


def validation_error(request, engine: JetStreamEngine) -> str | None:
    """Why `request` must not reach the orchestrator, or None if it is fine."""
    if isinstance(request, _Unparsable):
        return request.reason
    if request.max_tokens <= 0:
        return f"max_tokens must be >= 1, got {request.max_tokens}"
    which = request.WhichOneof("content")
    if which is None:
        return "request has no content: set text_content or token_content"
    is_bos = not request.session_cache  # what the orchestrator's prefill thread will use
    if which == "text_content":
        text = request.text_content.text
        if not text:
            return "empty prompt: text_content.text is ''"
        try:
            n = len(engine.tokenizer.encode_ids(text))
        except ValueError as e:
            return f"cannot tokenize the prompt: {e}"
    else:
        ids = list(request.token_content.token_ids)
        if not ids:
            return "empty prompt: token_content.token_ids is empty"
        vocab = engine.engine.model_cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            return f"token ids {bad[:5]} outside the vocabulary [0, {vocab})"
        n = len(ids)
    n += int(is_bos)
    if n == 0:
        return "empty prompt after tokenization"
    if n > engine.max_prefill_length:
        return (
            f"prompt has {n} tokens (BOS included: {is_bos}), more than max_prefill_length="
            f"{engine.max_prefill_length}"
        )
    return None


class ValidatingOrchestrator(jetstream_pb2_grpc.OrchestratorServicer):
    """Rejects malformed requests with INVALID_ARGUMENT, forwards the rest to JetStream."""

    def __init__(self, inner, engine: JetStreamEngine):
        """`inner`: JetStream's `LLMOrchestrator` for the engine's driver."""
        self._inner = inner
        self._engine = engine

    async def Decode(self, request, context):  # noqa: N802 (gRPC method name)
        error = validation_error(request, self._engine)
        if error is not None:
            _log.info("rejected request: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        async for response in self._inner.Decode(request, context):
            yield response

    async def HealthCheck(self, request, context):  # noqa: N802
        return await self._inner.HealthCheck(request, context)


def add_servicer(servicer: ValidatingOrchestrator, server: grpc.aio.Server) -> None:
    """`add_OrchestratorServicer_to_server` with a request parser that never raises."""
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode,
            request_deserializer=_parse_decode_request,
            response_serializer=jetstream_pb2.DecodeResponse.SerializeToString,
        ),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            servicer.HealthCheck,
            request_deserializer=jetstream_pb2.HealthCheckRequest.FromString,
            response_serializer=jetstream_pb2.HealthCheckResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("jetstream_proto.Orchestrator", handlers),)
    )


# ----------------------------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------------------------
def build_engine() -> JetStreamEngine:
    """The engine the flags describe, its weights from exactly one of: `--hf_checkpoint` (a
    Hugging Face Qwen3 directory), `--orbax_checkpoint` with `--model_preset` or
    `--model_config` (a StandardCheckpointer save of a `Transformer`'s `nnx.state`, any float
    dtype), `--trainer_checkpoint` (a `dvp_jax.main` workdir, its `checkpoints/` or one step's
    dir: the latest step's policy params; the architecture from its `model_config.json` unless
    `--model_preset` / `--model_config` say otherwise) or `--random_init_preset`. Every path
    reads straight into the rollout dtype and layout."""
    sources = [
        FLAGS.hf_checkpoint,
        FLAGS.orbax_checkpoint,
        FLAGS.trainer_checkpoint,
        FLAGS.random_init_preset,
    ]
    if sum(s is not None for s in sources) != 1:
        raise UserError(
            "give exactly one of --hf_checkpoint, --orbax_checkpoint, --trainer_checkpoint, "
            "--random_init_preset"
        )
    if FLAGS.max_prefill_length not in DEFAULT_PREFILL_LENGTHS:
        # JetStream's token-id padding (token_utils.pad_tokens) only accepts its own buckets.
        raise UserError(
            f"--max_prefill_length must be one of {DEFAULT_PREFILL_LENGTHS}, got "
            f"{FLAGS.max_prefill_length}"
        )
    config = EngineConfig(**{name: FLAGS[name].value for name in _ENGINE_FLAGS})
    tp = FLAGS.tensor_parallel
    mesh = make_mesh(MeshConfig(1, 1, tp), jax.devices()[:tp])
    sharder = Sharder(mesh, ROLLOUT_RULES)
    policy = DTypePolicy.named(FLAGS.dtype)
    params = None
    if FLAGS.random_init_preset:
        cfg = ModelConfig.preset(FLAGS.random_init_preset)
    elif FLAGS.hf_checkpoint:
        from dvp_jax.model import hf_import

        cfg = loading.hf_model_config(FLAGS.hf_checkpoint)
        params = nnx.state(hf_import.load_hf(FLAGS.hf_checkpoint, policy, sharder, cfg))
    elif FLAGS.trainer_checkpoint:
        path = FLAGS.trainer_checkpoint
        cfg = loading.trainer_model_config(path, FLAGS.model_preset, FLAGS.model_config)
        params = loading.load_trainer_params(path, cfg, policy, sharder)
    else:
        cfg = loading.model_config(FLAGS.model_preset, FLAGS.model_config)
        params = loading.load_orbax_params(FLAGS.orbax_checkpoint, cfg, policy, sharder)
    engine = RolloutEngine(cfg, config, tokenizer=FLAGS.tokenizer, params=params, mesh=mesh)
    return JetStreamEngine(engine, tokenizer_path=FLAGS.tokenizer)


def warm_up(engine: JetStreamEngine) -> None:
    """Compiles prefill (every bucket), insert and generate before the port opens."""
    state = engine.init_decode_state()
    for bucket in engine.engine.config.buckets:
        tokens = [0] * bucket
        prefix = engine.prefill(params=engine.params, padded_tokens=tokens, true_length=bucket)
        state = engine.insert(prefix, state, 0)
    state, result = engine.generate(engine.params, state)
    jax.block_until_ready(result.data)


# ----------------------------------------------------------------------------------------------
# Serving.
# ----------------------------------------------------------------------------------------------
class PortUnavailableError(RuntimeError):
    """`host:port` cannot be bound; the message is the one line the server exits with."""


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_BIND_ADVICE = {
    errno.EADDRINUSE: "address already in use; pick another --port or stop the process that "
    "holds it",
    errno.EACCES: "permission denied (ports below 1024 need privileges); pick another --port",
    errno.EADDRNOTAVAIL: "not an address of this machine; check --host",
}


def bind_problem(host: str, port: int) -> str | None:
    """Why gRPC could not listen on `host:port`, or None if a plain socket can bind it now.

    Binds (no listen) a socket the way gRPC's listener does (SO_REUSEADDR on, SO_REUSEPORT
    off), to every address `host` resolves to; like gRPC, one address that binds is enough.
    The answer can be stale by the time gRPC binds: `serve` still handles its own failure.
    """
    if not 0 <= port <= 65535:  # getaddrinfo would wrap it modulo 2**16, gRPC too.
        return f"cannot bind {_address(host, port)}: --port must be in 0..65535"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"cannot bind {_address(host, port)}: cannot resolve --host ({e})"
    first_error = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
            return None
        except OSError as e:
            first_error = first_error or e
    if first_error is None:
        return f"cannot bind {_address(host, port)}: --host resolves to no address"
    reason = _BIND_ADVICE.get(first_error.errno, first_error.strerror or str(first_error))
    return f"cannot bind {_address(host, port)}: {reason}"


async def serve(engine: JetStreamEngine, host: str, port: int) -> None:
    """Runs JetStream's driver + our validating servicer until SIGTERM / SIGINT.

    Raises:
        PortUnavailableError: `host:port` cannot be bound (nothing was started).
    """
    orchestrator = _orchestrator()
    # so_reuseport off: binding a port another process holds must fail, not share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    address = _address(host, port)
    # Bind before the driver exists: its detokenize thread is not a daemon, so a driver left
    # running by a failed bind kept the process alive. grpcio 1.85 raises RuntimeError
    # ("Failed to bind to address ..."); older releases returned 0.
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        await server.stop(None)
        problem = bind_problem(host, port) or f"cannot bind {address} (gRPC refused it)"
        raise PortUnavailableError(problem)
    address = _address(host, bound)  # The port gRPC chose when --port=0.

    driver = make_driver(engine)
    try:
        add_servicer(ValidatingOrchestrator(orchestrator.LLMOrchestrator(driver), engine), server)
        await server.start()
        _log.info("serving on %s (%d slots)", address, engine.max_concurrent_decodes)
        print(f"dvp_jax rollout server listening on {address}", flush=True)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        _log.info("shutting down")
    finally:
        try:
            await server.stop(grace=2.0)
        finally:
            driver.stop()
    print("dvp_jax rollout server stopped", flush=True)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: every option is a --flag", USAGE_EXIT_CODE)
    # Before the model is loaded (minutes for a real checkpoint): a busy port fails at once.
    problem = bind_problem(FLAGS.host, FLAGS.port)
    if problem is not None:
        fail(problem, USAGE_EXIT_CODE)
    _orchestrator()
    use_compilation_cache(FLAGS.compilation_cache)
    # JetStream's orchestrator logs every generate step at DEBUG: shown under --verbose only.
    logging.getLogger().setLevel(logging.DEBUG if FLAGS.verbose else logging.WARNING)
    _log.setLevel(logging.INFO)
    try:
        engine = build_engine()
    except (UserError, ValueError) as e:  # flags that do not fit, a checkpoint that does not
        fail(str(e), USAGE_EXIT_CODE, e)
    except OSError as e:  # a checkpoint or tokenizer path that cannot be read
        fail(one_line(e), USAGE_EXIT_CODE, e)
    warm_up(engine)
    try:
        asyncio.run(serve(engine, FLAGS.host, FLAGS.port))
    except PortUnavailableError as e:  # Taken since the check above.
        fail(str(e), USAGE_EXIT_CODE)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
