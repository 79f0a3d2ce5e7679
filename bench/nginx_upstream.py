"""Fixed-answer P/D upstreams on nginx (Debian's `nginx-light` + `libnginx-mod-http-echo`).

`pd-gateway bench overhead --upstream nginx` uses these instead of the emulator: the emulator is
Python and tops out around 1,200 P/D requests/s on one core, so behind it every router idles
between wake-ups and pays its per-wake-up costs on each request. nginx answers in C, fast
enough that the router under test becomes the bottleneck (the regime of the 2026-11-29 bare
proxies, docs/benchmarks.md, "The starting point").

Per engine and mode, one port each for the prefill, the decode and a colocated server. The
answers are fixed but shaped like the engines' (the gateway's guards accept them): the prefill
answers one token "a" and the prompt's token count; the decode answers `NONSTREAM_MAX_TOKENS`
tokens starting with "a", or a 64-event stream (in one write, or with `token_interval_ms` one
event per write that far apart, as an engine sends one per decode step); vLLM's prefill answer carries
`kv_transfer_params` whose `remote_request_id` embeds the request's `X-Request-Id`, as vLLM's does.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from bench import procs

NGINX = "/usr/sbin/nginx"
ECHO_MODULE = "/usr/lib/nginx/modules/ngx_http_echo_module.so"
INSTALL_HINT = "apt-get install nginx-light libnginx-mod-http-echo"


def available() -> str | None:
    """None when nginx and its echo module are installed, else what is missing."""
    if not Path(NGINX).exists() and shutil.which("nginx") is None:
        return f"nginx is not installed ({INSTALL_HINT})"
    if not Path(ECHO_MODULE).exists():
        return f"nginx's echo module is not installed ({INSTALL_HINT})"
    return None


@dataclass(frozen=True)
class Ports:
    prefill: int
    decode: int
    both: int


def _nginx_str(s: str) -> str:
    """A JSON text as one nginx single-quoted string (`$http_x_request_id` stays a variable)."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _completion(
    text: str, prompt_tokens: int, completion_tokens: int, extra: str = "", logprobs: object = None
) -> str:
    body = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench-model",
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        },
    }
    s = json.dumps(body, separators=(",", ":"))
    return s[:-1] + extra + "}" if extra else s


def prefill_answer(engine: str, prompt_tokens: int) -> str:
    """A prefill's answer: one token "a"; vLLM's adds `kv_transfer_params` whose
    `remote_request_id` holds the placeholder `REQID` for the request's X-Request-Id, and the
    logprobs of its 3 best first tokens, which the gateway asks a greedy request's prefill for."""
    extra = ""
    logprobs = None
    if engine == "vllm":
        logprobs = {
            "text_offset": [0],
            "token_logprobs": [-0.11],
            "tokens": ["a"],
            "top_logprobs": [{"a": -0.11, "b": -2.53, "c": -3.07}],
        }
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": "bench-engine",
            "remote_request_id": "cmpl-REQID-0-0000abcd",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": prompt_tokens,
        }
        extra = ',"kv_transfer_params":' + json.dumps(params, separators=(",", ":"))
    return _completion("a", prompt_tokens, 1, extra, logprobs)


def _stream(tokens: int) -> list[str]:
    events = []
    for i in range(tokens):
        finish = "length" if i == tokens - 1 else None
        ev = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 0,
            "model": "bench-model",
            "choices": [
                {"index": 0, "text": "a" if i == 0 else "b", "logprobs": None, "finish_reason": finish}
            ],
        }
        events.append("data: " + json.dumps(ev, separators=(",", ":")) + "\n\n")
    events.append("data: [DONE]\n\n")
    return events


def _server(
    port: int,
    role: str,
    engine: str,
    mode: str,
    prompt_tokens: int,
    max_tokens: int,
    bport: int,
    token_interval_ms: float = 0.0,
) -> str:
    models = json.dumps(
        {
            "object": "list",
            "data": [{"id": "bench-model", "object": "model", "owned_by": engine, "max_model_len": 8192}],
        },
        separators=(",", ":"),
    )
    info = json.dumps(
        {
            "model_path": "bench-model",
            "context_length": 8192,
            "max_req_input_len": 8186,
            "max_total_num_tokens": 1 << 20,
            "disaggregation_mode": {"both": "null"}.get(role, role),
            "disaggregation_bootstrap_port": bport,
        },
        separators=(",", ":"),
    )
    lines = [
        "    server {",
        f"        listen 127.0.0.1:{port} reuseport backlog=4096;",
        "        keepalive_requests 1000000;",
        "        location = /health { echo_status 200; echo -n ''; }",
        f"        location = /v1/models {{ default_type application/json; echo -n {_nginx_str(models)}; }}",
    ]
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        lines.append(
            f"        location = {path} {{ default_type application/json; echo -n {_nginx_str(info)}; }}"
        )
    if role == "prefill":
        body = prefill_answer(engine, prompt_tokens).replace("REQID", "$http_x_request_id")
        gen = [f"echo -n {_nginx_str(body)};"]
        ctype = "application/json"
    elif mode == "stream64":
        gen = []
        for i, ev in enumerate(_stream(64)):
            if i and token_interval_ms > 0:  # the previous event leaves now, this one later
                # (echo_sleep takes seconds with at most 3 decimals: 1 ms is the least)
                gen += ["echo_flush;", f"echo_sleep {max(token_interval_ms, 1.0) / 1000:.3f};"]
            gen.append(f"echo -n {_nginx_str(ev)};")
        ctype = "text/event-stream"
    else:
        gen = [f"echo -n {_nginx_str(_completion('a' + 'b' * (max_tokens - 1), prompt_tokens, max_tokens))};"]
        ctype = "application/json"
    for path in ("/v1/completions", "/generate", "/v1/chat/completions"):
        lines.append(f"        location = {path} {{")
        lines.append(f"            default_type {ctype};")
        lines.append("            echo_read_request_body;")
        lines += [f"            {g}" for g in gen]
        lines.append("        }")
    lines.append("        location / { return 404; }")
    lines.append("    }")
    return "\n".join(lines)


def write_config(
    prefix: Path,
    layout: dict[tuple[str, str], Ports],
    prompt_tokens: int,
    max_tokens: int,
    bport: int,
    token_interval_ms: float = 0.0,
) -> Path:
    servers = []
    for (engine, mode), ports in layout.items():
        for port, role in ((ports.prefill, "prefill"), (ports.decode, "decode"), (ports.both, "both")):
            servers.append(
                _server(port, role, engine, mode, prompt_tokens, max_tokens, bport, token_interval_ms)
            )
    conf = f"""load_module {ECHO_MODULE};
daemon off;
master_process off;
worker_processes 1;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_timeout 300s;
    tcp_nodelay on;
{chr(10).join(servers)}
}}
"""
    prefix.mkdir(parents=True, exist_ok=True)
    path = prefix / "nginx.conf"
    path.write_text(conf)
    return path


def start(
    group: procs.ProcessGroup,
    engines: list[str],
    modes: list[str],
    *,
    prompt_tokens: int,
    max_tokens: int,
    cpus: str | None,
    log_dir: Path,
    token_interval_ms: float = 0.0,
) -> tuple[procs.ManagedProcess, dict[tuple[str, str], Ports], int]:
    """One nginx process serving every (engine, mode) trio; returns it, the ports, and the
    (unused, but required by SGLang's protocol) bootstrap port the prefills announce.
    `token_interval_ms` > 0: a stream's events leave one per write, that far apart."""
    missing = available()
    if missing is not None:
        raise RuntimeError(missing)
    layout: dict[tuple[str, str], Ports] = {}
    for engine in engines:
        for mode in modes:
            p, d, b = procs.free_ports(3)
            layout[(engine, mode)] = Ports(p, d, b)
    bport = procs.free_port()
    prefix = log_dir / "nginx"
    conf = write_config(prefix, layout, prompt_tokens, max_tokens, bport, token_interval_ms)
    proc = group.add(
        procs.start_process("nginx", [NGINX, "-c", str(conf), "-p", str(prefix)], cpus=cpus, log_dir=log_dir)
    )
    for ports in layout.values():
        for port in (ports.prefill, ports.decode, ports.both):
            proc.wait_http(f"http://{procs.HOST}:{port}/health", timeout=30.0)
    return proc, layout, bport
