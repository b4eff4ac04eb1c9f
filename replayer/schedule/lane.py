"""The schedule lane: replay a request inside the batches it ran in, rebuilt from the recorded schedule.

On the engines reprolane supports, a request's numbers depend on the shapes of the batches it ran in, not on its
companions' content (`schemas.schedule`). This lane starts an in-process vLLM engine with the production engine's
recorded settings (`schemas.schedule.EngineStart`: batch limits, block size, KV blocks, chunked prefill, prefix
caching, policy, seed, dtype) and drives its step loop itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one
``LLMEngine.step`` per scheduler step): before each replayed step it adds the requests that arrived before the
recorded one, the target with its real prompt and sampling contract, every other request as a filler of the
same shape (`replayer.schedule.plan`). The engine runs vLLM's scheduler with the same recorder production
runs (``capture.schedule.recorder.RecordingScheduler``, named to vLLM as a string: the replayer does not import
the capture package), so each replayed step's shapes are read back from the replay's own log and compared with
the recorded ones (`compare_steps`); the first step that differs is reported and the schedule is then not
reproduced, whatever the tokens say.

One engine serves many replays: between replays it is drained (every request finished or aborted, so the
persistent batch is empty, as production's was at the start of a busy period). Its prefix cache is kept
(``schedule_reuse_cache``): a replay whose prefix-cache providers' busy periods an earlier replay ran, later in the
log than every step replayed since, runs only its own periods and reads those blocks from the cache, computed in
the recorded shapes as a fresh run would compute them (a server's shared system prompt: its period is replayed once,
not for every reader). Otherwise the cache is reset and the whole plan runs. A replay that reused the cache and did
not reproduce the schedule (a block production had evicted and the replay engine kept shows as a step's computed
tokens) is run again from an empty cache, so reuse never changes a verdict (`ScheduleLane._holds`).
A replay refuses (`NotReplayableError`, naming the fields) when this process's runtime fingerprint differs from
the production engine's in a field that changes numerics (`NUMERIC_FIELDS`).

`replay_window` replays every request of a window with its real content together (all `GenRequest` known).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from infra.clients.installed import installed_structured_outputs
from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes.adapters import refuse
from replayer.lanes.base import (
    LANE_STRUCTURED_OUTPUTS_BACKEND,
    GenRequest,
    quiet_imports,
    resolve_model_dir,
    torch_lane_fingerprint,
)
from replayer.lanes.engine_thread import EngineThread, set_torch_threads
from replayer.lanes.vllm_lane import output_from_vllm, release_engine
from replayer.schedule.engine import (
    read_log,
    sampling_params,
    start_recording_engine,
    steps_from,
)
from replayer.schedule.plan import (
    FillerPlan,
    ReplayPlan,
    WindowTooLongError,
    check_target,
    hit_providers,
    plan_replay,
)
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint
from schemas.schedule import EngineStart, ScheduleStep
from schemas.schedule_log import ScheduleLog

#: Fingerprint fields that change a request's numbers: a replay refuses when one differs from production's.
NUMERIC_FIELDS: Final = (
    "engine",
    "engine_version",
    "torch_version",
    "cuda_version",
    "cublas_version",
    "device",
    "device_name",
    "compute_capability",
    "dtype",
    "quantization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "attention_backend",
    "cuda_graphs",
    "batch_invariant",
    "num_threads",
)
#: Model-config keys that mark a mixture-of-experts model: its expert routing depends on every token of the batch,
#: companions' content included, so fillers cannot stand in for companions (window replay still can).
MOE_CONFIG_KEYS: Final = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
)
#: Filler token ids are drawn from [FILLER_LOW, vocab): low ids are the special tokens of most vocabularies.
FILLER_LOW: Final = 1000
#: How long a replay waits for a structured-output request's grammar to compile before refusing.
GRAMMAR_WAIT_S: Final = 60.0
#: The most token ids the lane keeps of the requests whose prefix cache it holds between replays (about 40 MB);
#: past it, the next replay starts from an empty cache.
KEPT_TOKENS_MAX: Final = 1 << 20


@dataclass(frozen=True)
class _Kept:
    """What the replay engine's prefix cache holds since it was last reset (`ScheduleLane._keep`): the recorded
    busy periods of one production engine replayed into it (each replay reproduced its schedule), the tokens each
    of their requests had in the replay, and the last recorded step replayed."""

    engine_id: str | None = None
    periods: frozenset[tuple[int, int]] = frozenset()
    tokens: dict[str, Sequence[int]] = field(default_factory=dict)  # never changed in place: replaced whole
    last_step: int = -1


@dataclass(frozen=True)
class StepMismatch:
    """The first replayed step whose shapes differ from the recorded step (ids as production's)."""

    step: int
    recorded: tuple[tuple[str, int, int], ...]
    replayed: tuple[tuple[str, int, int], ...]
    reason: str


@dataclass(frozen=True)
class StepCheck:
    """The replay's steps against the recorded ones (`compare_steps`): how many matched, then the first that did
    not (None when every recorded step was reproduced)."""

    compared: int
    mismatch: StepMismatch | None = None


@dataclass
class ScheduleReplay:
    """What a schedule replay gives: the target's output and whether the recorded schedule was reproduced."""

    output: ReplayedOutput | None
    outputs: dict[str, ReplayedOutput]
    steps: StepCheck
    notes: list[str] = field(default_factory=list)
    fillers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # production id -> the filler's prompt
    periods: tuple[tuple[int, int], ...] = ()  # the recorded busy periods the replay rests on (`ReplayPlan.periods`)
    #: those of them not run again: an earlier replay ran them, and their prefix cache was reused (`ScheduleLane`)
    reused: tuple[tuple[int, int], ...] = ()

    @property
    def schedule_reproduced(self) -> bool:
        return self.steps.mismatch is None and not self.notes


def numeric_differences(recorded: RuntimeFingerprint | None, replay: RuntimeFingerprint) -> list[str]:
    """The numerics-relevant fields whose known values differ (``"device_name: 'A' != 'B'"``)."""
    if recorded is None:
        return ["runtime: the schedule log does not record the production engine's fingerprint"]
    out = []
    for name in NUMERIC_FIELDS:
        a, b = getattr(recorded, name), getattr(replay, name)
        if a is not None and b is not None and a != b:
            out.append(f"{name}: {a!r} != {b!r}")
    return out


def moe_markers(hf_config: Any) -> list[str]:
    """The mixture-of-experts keys a model config sets (non-zero), e.g. ``["num_local_experts=8"]``."""
    found = []
    configs = [hf_config, getattr(hf_config, "text_config", None)]
    for cfg in configs:
        if cfg is None:
            continue
        for key in MOE_CONFIG_KEYS:
            value = getattr(cfg, key, None)
            if value:
                found.append(f"{key}={value}")
    return found


#: A step's shape: (engine request id, tokens computed before, tokens scheduled) per scheduled request, in order.
Shape = tuple[tuple[str, int, int], ...]


def _shape(step: ScheduleStep, ids: Mapping[str, str] | None = None) -> Shape:
    name = (lambda r: ids.get(r, r)) if ids is not None else (lambda r: r)
    return tuple((name(s.engine_request_id), s.num_computed_tokens, s.num_scheduled_tokens) for s in step.scheduled)


def _shape_difference(recorded: Shape, replayed: Shape) -> str:
    """The words of a step whose shapes differ: which (request, computed, scheduled) entries only one side has."""
    only_recorded = [e for e in recorded if e not in replayed][:3]
    only_replayed = [e for e in replayed if e not in recorded][:3]
    words = "scheduled requests or token counts differ"
    if not only_recorded and not only_replayed:
        return words + " (the same entries in another order)"
    return f"{words} (recorded only: {only_recorded}; replayed only: {only_replayed})"


def compare_steps(
    recorded: ScheduleLog, steps: Sequence[int], replayed: list[ScheduleStep], to_production: Mapping[str, str]
) -> StepCheck:
    """Compare the recorded steps numbered ``steps`` with the replay's steps (in order; ids mapped to
    production's)."""
    compared = 0
    for offset, number in enumerate(steps):
        rec = recorded.steps.get(number)
        if rec is None:
            return StepCheck(compared, StepMismatch(number, (), (), "the recorded log has no such step"))
        if offset >= len(replayed):
            return StepCheck(compared, StepMismatch(number, _shape(rec), (), "the replay ended before this step"))
        rep = replayed[offset]
        a, b = _shape(rec), _shape(rep, to_production)
        if a != b:
            return StepCheck(compared, StepMismatch(number, a, b, _shape_difference(a, b)))
        if set(rec.preempted) != {to_production.get(r, r) for r in rep.preempted}:
            return StepCheck(compared, StepMismatch(number, a, b, "preempted requests differ"))
        compared += 1
    return StepCheck(compared)


class ScheduleLane:
    """An in-process vLLM built with one production engine's settings; replays targets and windows."""

    name = "schedule"

    def __init__(self, settings: ReplayerSettings, engine: EngineStart, *, refuse_on_mismatch: bool = True) -> None:
        self._thread = EngineThread("schedule-lane")  # the engine is built and stepped on it (engine_thread)
        try:
            self._thread.call(self._start, settings, engine)
        except BaseException:
            self._thread.close()
            raise
        self.refusals = numeric_differences(engine.runtime, self._fingerprint)
        if self.refusals and refuse_on_mismatch:
            self.close()
            raise NotReplayableError("the schedule lane's runtime differs in numerics: " + "; ".join(self.refusals))

    def _start(self, settings: ReplayerSettings, engine: EngineStart) -> None:
        model_dir = resolve_model_dir(settings)
        self._log_dir = Path(tempfile.mkdtemp(prefix="reprolane-schedule-lane-"))
        self.engine_start = engine
        self.max_steps = settings.schedule_max_steps  # the most recorded steps one replay runs
        self.reuse_cache = settings.schedule_reuse_cache
        self._kept = _Kept()
        threads = engine.runtime.num_threads if engine.runtime is not None else None
        if threads:  # production's torch thread count: a CPU matmul's reduction order depends on it
            with quiet_imports():
                import torch
            set_torch_threads(torch, threads)  # on this engine's thread
        self._engine, self._recorder = start_recording_engine(
            model_dir,
            self._log_dir,
            dtype=engine.dtype,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            block_size=engine.block_size,
            num_gpu_blocks_override=engine.num_kv_blocks,
            enable_chunked_prefill=engine.enable_chunked_prefill,
            enable_prefix_caching=engine.enable_prefix_caching,
            scheduling_policy=engine.scheduling_policy,
            long_prefill_token_threshold=engine.long_prefill_token_threshold or 0,
            seed=engine.seed if engine.seed is not None else 0,
            enforce_eager=engine.enforce_eager if engine.enforce_eager is not None else True,
        )
        with quiet_imports():
            import torch
            import vllm
        self._scheduler: Any = self._engine.engine_core.engine_core.scheduler
        self._vocab = int(self._engine.model_config.get_vocab_size())
        self.moe = moe_markers(self._engine.model_config.hf_config)
        self._lock = threading.Lock()
        self._closed = False
        self._fingerprint = torch_lane_fingerprint(
            torch,
            engine="vllm",
            engine_version=vllm.__version__,
            dtype=engine.dtype,
            attention_backend=None,
            batch_invariant=False,
            structured_outputs=installed_structured_outputs(LANE_STRUCTURED_OUTPUTS_BACKEND),
        ).model_copy(update={"max_num_seqs": engine.max_num_seqs, "prefix_caching": engine.enable_prefix_caching})
        own = read_log(self._recorder, consume=True).engine  # its own start, measured where production's was
        if own is not None and own.runtime is not None and own.runtime.num_threads is not None:
            # torch's thread count as the engine's scheduler saw it, not this process's before the engine started
            self._fingerprint = self._fingerprint.model_copy(update={"num_threads": own.runtime.num_threads})

    def fingerprint(self) -> RuntimeFingerprint:
        return self._fingerprint

    # -- the replays --------------------------------------------------------------------------------------------

    def replay_target(self, log: ScheduleLog, target: str, request: GenRequest) -> ScheduleReplay:
        """Replay ``target`` (engine request id in ``log``) with fillers for every other request of its window
        (`replay_requests` of the one request). Refused for a mixture-of-experts model (`moe_markers`): its numbers
        depend on companions' content."""
        if self.moe:
            raise NotReplayableError(
                "mixture-of-experts model (" + ", ".join(self.moe) + "): expert routing depends on the companions' "
                "content, so filler companions cannot reproduce the batch; use window replay with real content"
            )
        return self.replay_requests(log, {target: request})

    def replay_requests(self, log: ScheduleLog, requests: Mapping[str, GenRequest]) -> ScheduleReplay:
        """Replay several requests of the log with their real content in one run (``requests``: by engine request
        id, the first one the plan's target): every choice of a request with ``n > 1``, or the captured requests of
        one busy period; fillers stand in for every other request of their window, and the window ends when the
        last of them finished. The outputs are in `ScheduleReplay.outputs` by engine request id, the first one's
        also as ``output``. A mixture-of-experts model is replayed only when no filler is needed (expert routing
        depends on every companion's content); otherwise it is refused, naming the companions that were not
        captured."""
        ids = list(requests)
        try:
            for rid in ids:
                check_target(log, rid, len(requests[rid].prompt_token_ids))
        except (KeyError, ValueError) as exc:
            raise NotReplayableError(str(exc)) from exc
        plan = self._plan(log, ids[0], also=tuple(ids[1:]))
        if self.moe:
            fillers = [p.arrival.engine_request_id for p in plan.requests]
            fillers = [rid for rid in fillers if rid not in requests]
            if fillers:
                raise NotReplayableError(
                    "mixture-of-experts model (" + ", ".join(self.moe) + "): expert routing depends on the "
                    f"companions' content, and {len(fillers)} companion(s) of the window were not captured "
                    f"({', '.join(fillers[:5])}{', ...' if len(fillers) > 5 else ''})"
                )
        return self._thread.call(self._run, log, plan, dict(requests))

    def replay_window(self, log: ScheduleLog, requests: Mapping[str, GenRequest], target: str) -> ScheduleReplay:
        """Replay every request of ``target``'s window with its real content (``requests`` by engine request id;
        one that is missing is refused); all outputs are returned in `ScheduleReplay.outputs`."""
        plan = self._plan(log, target)
        missing = [p.arrival.engine_request_id for p in plan.requests if p.arrival.engine_request_id not in requests]
        if missing:
            raise NotReplayableError(f"window replay needs every request of the window; missing: {missing}")
        return self._thread.call(self._run, log, plan, dict(requests), until_all=True)

    def _plan(self, log: ScheduleLog, target: str, also: tuple[str, ...] = ()) -> ReplayPlan:
        """The target's plan (`plan_replay`); refused when it would run more than ``schedule_max_steps`` recorded
        steps."""
        try:
            return plan_replay(
                log, target, max_model_len=self.engine_start.max_model_len, max_steps=self.max_steps, also=also
            )
        except WindowTooLongError as exc:
            raise NotReplayableError(f"{exc} (schedule_max_steps)") from exc

    def _run(
        self, log: ScheduleLog, plan: ReplayPlan, real: dict[str, GenRequest], *, until_all: bool = False
    ) -> ScheduleReplay:
        """Run ``plan`` on the engine: from the prefix cache earlier replays left when it holds the plan's providers'
        periods (`_holds`), run again from an empty cache when that replay did not reproduce the schedule (a block
        the replay engine kept but production had evicted, or the reverse, shows as a step's computed tokens)."""
        for request in real.values():  # its engine starts without LoRA (EngineStart records none): never dropped
            refuse(request.adapter, self.name)
        notes = list(plan.notes) + [f"schedule log: {p}" for p in log.problems()]
        with self._lock:
            if self._closed:
                raise LaneUnavailableError("the schedule lane is closed")
            held = self._holds(log, plan, real) if not notes else ()
            replay, tokens = self._drive(log, plan.without(held) if held else plan, real, until_all, held)
            if held and replay.steps.mismatch is not None:
                held = ()
                replay, tokens = self._drive(log, plan, real, until_all, held)
            replay.notes, replay.periods, replay.reused = notes, plan.periods, held
            self._keep(log, replay, tokens)
        return replay

    def _drive(
        self,
        log: ScheduleLog,
        plan: ReplayPlan,
        real: dict[str, GenRequest],
        until_all: bool,
        held: tuple[tuple[int, int], ...],
    ) -> tuple[ScheduleReplay, dict[str, tuple[int, ...]]]:
        """One run of ``plan``'s periods, the engine drained first (and its prefix cache reset unless ``held``
        periods are reused): the replay, its own steps compared with the recorded ones, and the tokens (prompt and
        output, by production id) of every request it sent."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._drain(reset=not held)
        log_first = first_step = int(self._recorder.step)
        to_production: dict[str, str] = {}  # the replay's engine request id -> production's
        by_name: dict[str, str] = {}  # the replay's external id (what outputs carry) -> production's
        to_replay: dict[str, str] = {}
        # production id -> the replayed request's tokens (prompt + output); a reused period's from its replay (read
        # through, not copied: the kept tokens may be many)
        tokens: ChainMap[str, Sequence[int]] = ChainMap({}, self._kept.tokens if held else {})
        fillers: dict[str, tuple[int, ...]] = {}
        outputs: dict[str, Any] = {}
        pending = list(plan.requests)
        target_id = plan.target
        waiting = set(real)  # the real requests not finished yet: the replay runs until none is
        while True:
            rel = int(self._recorder.step) - first_step
            while pending and pending[0].due_step - plan.start_step <= rel:
                item = pending.pop(0)
                rid = item.arrival.engine_request_id
                if rid in real:
                    prompt = list(real[rid].prompt_token_ids)
                    params = sampling_params(real[rid], self._engine.get_tokenizer())
                else:
                    reader = real.get(item.prefix_of) if item.prefix_of is not None else None
                    prompt = self._filler_prompt(item, tokens, reader)
                    fillers[rid] = tuple(prompt)
                    params = SamplingParams(
                        max_tokens=item.output_tokens,
                        min_tokens=item.output_tokens,
                        ignore_eos=True,
                        temperature=0.0,
                    )
                name = f"replay-{len(to_replay)}"
                new_id = self._engine.add_request(name, TokensPrompt(prompt_token_ids=prompt), params)
                self._await_grammar(new_id)
                to_production[new_id] = rid
                by_name[name] = rid
                to_replay[rid] = new_id
                tokens[rid] = list(prompt)
            if not waiting and not until_all:
                break
            if not self._engine.has_unfinished_requests():
                if not pending:
                    break
                # production was idle here, or ran busy periods the plan leaves out (they provided nothing):
                # the next arrival is due at the step that comes next
                first_step -= pending[0].due_step - plan.start_step - rel
                continue
            for out in self._engine.step():
                prod_id = by_name.get(out.request_id)
                if prod_id is None:
                    continue
                tokens[prod_id] = list(out.prompt_token_ids or []) + list(out.outputs[0].token_ids)
                if out.finished:
                    outputs[prod_id] = out.outputs[0]
                    waiting.discard(prod_id)
        self._drain(reset=False)
        replayed = steps_from(read_log(self._recorder, consume=True), log_first)  # each step read once
        results = {rid: output_from_vllm(o) for rid, o in outputs.items() if rid in real}
        replay = ScheduleReplay(
            output=results.get(target_id),
            outputs=results,
            steps=compare_steps(log, plan.steps, replayed, to_production),
            fillers=fillers,
        )
        return replay, {rid: tuple(tokens[rid]) for rid in to_replay}

    # -- the prefix cache kept between replays ------------------------------------------------------------------

    def _holds(self, log: ScheduleLog, plan: ReplayPlan, real: Mapping[str, GenRequest]) -> tuple[tuple[int, int], ...]:
        """The periods of ``plan`` whose prefix cache the engine holds from earlier replays and this one may
        reuse (none: run the whole plan from an empty cache). Reused only when

        - the cache holds only replays of the same production engine, each of which reproduced its schedule;
        - every period this replay still runs comes after every step replayed into the cache (a block of a period
          production had not run yet would be a hit production never had);
        - each block a real request reads from a reused period holds that request's own tokens there (the earlier
          replay's fillers carried the prefix *its* real requests read, random ids past it)."""
        kept = self._kept
        if not self.reuse_cache or kept.engine_id is None or log.engine is None:
            return ()
        if log.engine.engine_id != kept.engine_id:
            return ()
        held = tuple(p for p in plan.periods if p in kept.periods)
        rest = [p for p in plan.periods if p not in kept.periods]
        if not held or not rest or rest[0][0] <= kept.last_step:
            return ()
        block = self.engine_start.block_size
        for rid, request in real.items():
            arrival = log.arrivals.get(rid)
            for i, provider in enumerate(hit_providers(arrival) if arrival is not None else ()):
                have = kept.tokens.get(provider)
                if have is None:
                    continue  # computed in a period this replay runs
                span = slice(i * block, (i + 1) * block)
                if tuple(have[span]) != tuple(request.prompt_token_ids[span]):
                    return ()
        return held

    def _keep(self, log: ScheduleLog, replay: ScheduleReplay, sent: dict[str, tuple[int, ...]]) -> None:
        """Remember what the engine's prefix cache now holds: the periods this replay ran (added to those it
        reused) and the tokens of the requests it ``sent``, when it reproduced the schedule; forget everything
        otherwise, or past `KEPT_TOKENS_MAX`."""
        engine_id = log.engine.engine_id if log.engine is not None else None
        if not self.reuse_cache or not replay.schedule_reproduced or engine_id is None:
            self._kept = _Kept()
            return
        ran = [p for p in replay.periods if p not in replay.reused]
        base = self._kept  # what the replay reused; empty after a run from a reset cache (`_drain`)
        tokens = {**base.tokens, **sent}
        if sum(len(t) for t in tokens.values()) > KEPT_TOKENS_MAX:
            self._kept = _Kept()  # the next replay resets the cache and starts again
            return
        self._kept = _Kept(
            engine_id=engine_id,
            periods=base.periods | frozenset(ran),
            tokens=tokens,
            last_step=max(high for _, high in ran),
        )

    def _filler_prompt(
        self, item: FillerPlan, tokens: Mapping[str, Sequence[int]], target: GenRequest | None
    ) -> list[int]:
        """Random ids, the cache-hit blocks copied from their providers' replayed tokens, a real request's prefix
        (``target``: `FillerPlan.prefix_of`'s request) where it later reads this filler's blocks. The random ids are
        drawn from the production request's id: two fillers never share them, in one replay or in two whose prefix
        cache the engine kept (a shared block would be a hit production never had)."""
        rng = random.Random(item.arrival.engine_request_id)
        n = item.arrival.num_prompt_tokens
        prompt = [rng.randrange(FILLER_LOW, self._vocab) for _ in range(n)]
        block = self.engine_start.block_size
        for i, provider in enumerate(item.hit_blocks):
            source = tokens.get(provider)
            if source is None or len(source) < (i + 1) * block:
                break
            prompt[i * block : (i + 1) * block] = source[i * block : (i + 1) * block]
        if target is not None and item.target_prefix:
            prompt[: item.target_prefix] = list(target.prompt_token_ids[: item.target_prefix])
        return prompt

    def _await_grammar(self, engine_request_id: str) -> None:
        """Block until the request's grammar has compiled (vLLM compiles it in the background and passes the request
        over until then): it is then schedulable at the step it was added before, as the plan expects."""
        request = self._scheduler.requests.get(engine_request_id)
        structured = getattr(request, "structured_output_request", None)
        if structured is None:
            return
        deadline = time.monotonic() + GRAMMAR_WAIT_S
        while not structured.is_grammar_ready:
            if time.monotonic() > deadline:
                raise NotReplayableError(f"the grammar of {engine_request_id} did not compile in {GRAMMAR_WAIT_S} s")
            time.sleep(0.002)
        if isinstance(structured.grammar, Exception):  # vLLM would finish the request without a token
            raise NotReplayableError(f"the grammar of the recorded constraint did not compile: {structured.grammar!r}")

    def _drain(self, *, reset: bool) -> None:
        """Finish (abort) whatever is left and step until the engine is empty; with ``reset``, forget the prefix
        cache too (and what `_keep` remembered of it)."""
        left = list(self._engine.output_processor.request_states)
        if left:
            self._engine.abort_request(left)
        for _ in range(1000):
            if not self._engine.has_unfinished_requests() and not self._scheduler.has_requests():
                break
            self._engine.step()
        if reset:
            self._engine.reset_prefix_cache()
            self._kept = _Kept()

    def close(self) -> None:
        with self._lock if hasattr(self, "_lock") else threading.Lock():
            if getattr(self, "_closed", False):
                return
            self._closed = True
        recorder = getattr(self, "_recorder", None)
        engine = getattr(self, "_engine", None)
        if engine is not None:
            self._thread.call(release_engine, engine)
        if recorder is not None:
            recorder.writer.close()
        self._thread.close()
        if hasattr(self, "_log_dir"):
            shutil.rmtree(self._log_dir, ignore_errors=True)
