"""Before dispatch: what the chosen workers cannot take (token ids beyond a vocabulary, a prompt
that cannot fit: the length preflight, docs/guards.md guard 1), and, for a plan that is a
`Reject`, the error that says why as precisely as the request allows."""

from __future__ import annotations

from common.errors import BadRequest, ContextLengthExceeded, GatewayError, ModelNotFound, NoWorker
from common.request import ParsedRequest
from common.workers import Role, RouteKind, WorkerState
from gateway.guards import Guard, preflight
from gateway.orchestration.services import Services
from policies.snapshot import Reject


def check_vocab(req: ParsedRequest, chosen: tuple[WorkerState, ...]) -> None:
    """Token ids beyond a worker's (configured) vocabulary: a 400 here, not a dead engine (SGLang
    0.5.23 does not check them; its scheduler's embedding lookup raises and the server exits)."""
    for w in chosen:
        if w.vocab_size is not None and req.max_id >= w.vocab_size:
            raise BadRequest(
                f"Token id {req.max_id} is out of vocabulary (the model has {w.vocab_size} tokens)",
                param=req.id_param,
            )


def check_fits(s: Services, req: ParsedRequest, request_id: str, chosen: tuple[WorkerState, ...]) -> None:
    """The checks a plan's workers must pass before any leg is sent: vocabulary and length."""
    if req.max_id >= 0:
        check_vocab(req, chosen)
    g = s.cfg.guards
    if not g.length_preflight:
        return
    why = preflight(req.prompt_peak, req.prompt_is_ids, req.max_tokens, chosen, g, pairs=req.prompt_pairs)
    if why is None:
        return
    s.guard_failed(Guard.LENGTH_PREFLIGHT, "preflight", request_id, why)
    if why.startswith("max_tokens"):
        param = "max_new_tokens" if req.route is RouteKind.GENERATE else "max_tokens"
    elif req.route is RouteKind.GENERATE:
        param = "input_ids" if req.prompt_is_ids else "text"
    else:
        param = "messages" if req.route is RouteKind.CHAT else "prompt"
    raise ContextLengthExceeded(why, param=param)


def fits_quietly(s: Services, req: ParsedRequest, chosen: tuple[WorkerState, ...]) -> bool:
    """Would `chosen` pass `check_fits`? (Asked of a decode to move to: nothing counted.)"""
    if req.max_id >= 0:
        try:
            check_vocab(req, chosen)
        except BadRequest:
            return False
    g = s.cfg.guards
    return not (
        g.length_preflight
        and preflight(req.prompt_peak, req.prompt_is_ids, req.max_tokens, chosen, g, pairs=req.prompt_pairs)
    )


def rejected(s: Services, req: ParsedRequest, plan: Reject) -> GatewayError:
    """The error for a plan that is a `Reject`: an unknown model (404), a route the model's
    engines do not answer or a request only a colocated worker could answer (400), else no
    worker now (503)."""
    if plan.status == 404:
        return ModelNotFound(plan.reason, param="model")
    mine = [w for w in s.registry.workers() if w.model == req.model]
    if mine and not any(req.route in w.adapter.routes for w in mine):
        engines = ", ".join(sorted({w.engine.value for w in mine}))
        return BadRequest(
            f"model {req.model!r} is served by {engines} workers, which do not answer "
            f"{req.path} (SGLang's native route); use /v1/completions or /v1/chat/completions",
            param="model",
        )
    if req.local_prefill is not None and req.local_prefill.all_engines and mine:
        alone = s.registry.decodes_not_alone()
        if all(w.role is not Role.COLOCATED and (w.role is Role.PREFILL or w.id in alone) for w in mine):
            return BadRequest(
                f"{req.local_prefill.why}, which model {req.model!r} cannot answer: it is "
                "served only by SGLang prefill/decode pairs, and only the prefill computes "
                "the prompt (the decode's answer would lack it); use /generate with "
                "return_logprob and logprob_start_len, or serve the model on a colocated "
                "worker too",
                param=req.local_prefill.param,
            )
    return NoWorker(plan.reason, retry_after_s=s.cfg.limits.retry_after_s)
