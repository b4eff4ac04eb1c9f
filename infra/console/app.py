"""The console's web application: routes, the session and CSRF gate, the access log around every action.

Pages (server-rendered, Jinja2 with autoescaping; no script of the page is inline, so the Content-Security-Policy
can forbid inline scripts; plotly.js and the console's own script come from the console itself):

    GET  /login, POST /login, POST /logout         an operator key opens a server-side session (`sessions`); the
                                                   login returns to the page that sent the browser to it
    GET  /search                                   search by ids, tenant, time range, verdict, runtime
    GET  /requests/{id}                            one request: replays, shadow pair, Merkle inclusion, legal hold
    POST /requests/{id}/hold                       place or lift its legal hold (hold-admin): a reason and/or case
                                                   number and a confirmation, then a redirect to the record
    POST /requests/{id}/replay                     "replay now": the replayer service replays it (`replay_now`)
    GET  /requests/{id}/evidence                   its evidence bundle (`capture.audit.evidence.export`), a zip
    GET  /workflows/{id}                           a workflow's steps, the first divergent one marked
    GET  /overview                                 the charts (`charts`)

The gate (`Console.gate`): no session is a redirect to the login page, which returns to the page asked for
once the key proves itself (``/login?next=``, only ever a page of this console: `forms.next_path`; a POST:
401); a role the key lacks is 403; a record of another tenant is 404, the same answer as no record at all; a
state-changing form without the session's CSRF token is 403. Every one of those refusals, and every allowed
action, is written to the access log (`access`) before the answer is sent; when that write fails the answer is
503 and nothing is done.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qsl, quote, urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from capture.audit.access_log import AccessLog
from capture.audit.errors import AuditError, AuditStoreError
from capture.ledger.errors import KeyFileError, LedgerError
from infra.console import charts, forms
from infra.console.operators import SESSION_ROLE, Operator, OperatorKeys
from infra.console.records import READ_ERRORS, NotVisible, Records
from infra.console.replay_now import NO_KEY, ReplayNowError, ReplayPublisher
from infra.console.request_view import recorded_choice, replay_view, shadow_view
from infra.console.sessions import LOGIN_CSRF_COOKIE, SESSION_COOKIE, Session, SessionStore, new_token, same_token
from infra.console.tokens import TokenDecoder, decoder_for
from replayer.settings import Thresholds
from schemas import Envelope
from schemas.access_log import ACTION_ROLES, OperatorAction

HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
MAX_FORM_BYTES = 16 * 1024
SEARCH_ERRORS: tuple[type[Exception], ...] = (*READ_ERRORS, ValueError)


class Refused(Exception):
    """An action the gate refused (already logged); the status and the message the page shows (with the
    session's navigation when there is one)."""

    def __init__(self, status: int, message: str, session: Session | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.session = session


@dataclass
class Console:
    """Everything a request handler needs, built once by `infra.console.cli`."""

    records: Records
    access: AccessLog
    sessions: SessionStore
    keys_path: Path | None
    secure_cookie: bool = False
    replay: ReplayPublisher | None = None
    search_limit: int = 50  # rows per page of results
    decoder: TokenDecoder | None = None
    #: How a shadow pair is judged: the replayer's thresholds (``REPROLANE_REPLAYER_THRESHOLD_*``).
    thresholds: Thresholds = field(default_factory=Thresholds)

    def keys(self) -> OperatorKeys | None:
        """The key store as it is now (read per login and per request, so a revoked key ends its sessions)."""
        if self.keys_path is None:
            return None
        return OperatorKeys.load(self.keys_path, field="REPROLANE_OPERATOR_KEYS_PATH")

    def log(self, request: Request, action: OperatorAction, target: str, operator: Operator | None,
            tenant: str | None = None, refused: str | None = None, *, note: str | None = None,
            case: str | None = None, held_envelopes: tuple[str, ...] = ()) -> None:  # fmt: skip
        peer = request.client.host if request.client is not None else None
        self.access.record(action, target, operator=operator, tenant=tenant, refused=refused, peer=peer, note=note,
                           case=case, held_envelopes=held_envelopes)  # fmt: skip

    def gate(self, request: Request, action: OperatorAction, target: str, tenant: str | None = None) -> Session:
        """The request's live session, if its key is still in the store and has the action's role (see module
        docstring); a refusal is logged and raised as `Refused`."""
        session = self.sessions.get(request.cookies.get(SESSION_COOKIE))
        if session is not None:
            keys = self.keys()
            if keys is None or not keys.still(session.operator):
                self.sessions.close(request.cookies.get(SESSION_COOKIE))
                self.log(request, action, target, session.operator, tenant, "the session's key was revoked")
                raise Refused(401, "your key is no longer in the key store: log in again")
        if session is None:
            self.log(request, action, target, None, tenant, "no session (not logged in or expired)")
            raise Refused(401, "log in first")
        role = ACTION_ROLES[action]
        if not session.operator.may(role):
            why = f"operator key {session.operator.key_id!r} lacks the {role!r} role"
            self.log(request, action, target, session.operator, tenant, why)
            raise Refused(403, f"refused: {why}")
        return session

    async def check_csrf(self, request: Request, session: Session, values: dict[str, str], action: OperatorAction,
                         target: str) -> None:  # fmt: skip
        """A state-changing form must carry the session's CSRF token (else logged and `Refused`)."""
        if not same_token(values.get("csrf"), session.csrf):
            await run_in_threadpool(self.log, request, action, target, session.operator, None,
                                    "missing or wrong CSRF token")  # fmt: skip
            raise Refused(403, "refused: the form's CSRF token is missing or wrong (reload the page)")


async def read_form(request: Request) -> dict[str, str]:
    """The posted form's fields (URL-encoded; the last value of a repeated name), read no further than
    `MAX_FORM_BYTES` (413 beyond: a declared length is refused before anything is read)."""
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit() or int(declared) > MAX_FORM_BYTES:
        raise Refused(413, "form too large")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise Refused(413, "form too large")
    try:
        return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=32))
    except ValueError:
        raise Refused(400, "form has too many fields") from None


def _templates() -> Jinja2Templates:
    directory = Path(str(resources.files("infra.console") / "templates"))
    templates = Jinja2Templates(directory=str(directory))
    templates.env.globals["roles_of"] = lambda op: ", ".join(sorted(op.roles))
    return templates


def build_console_app(console: Console) -> Starlette:
    templates = _templates()

    def page(request: Request, name: str, session: Session | None, status: int = 200, **context: Any) -> Response:
        context.update(operator=session.operator if session else None, csrf=session.csrf if session else "")
        return templates.TemplateResponse(request, name, context, status_code=status)

    def refused_page(request: Request, exc: Refused) -> Response:
        if exc.status == 401 and request.method == "GET":  # to the login, which returns here (a deep link kept)
            here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            back = forms.next_path(here)
            return RedirectResponse("/login" + (f"?{urlencode({'next': back})}" if back else ""), status_code=303)
        title = "Not found" if exc.status == 404 else "Refused"
        return page(request, "message.html", exc.session, exc.status, title=title, message=str(exc))

    Handler = Callable[[Request], Awaitable[Response]]

    def handled(fn: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                return await fn(request)
            except Refused as exc:
                return refused_page(request, exc)
            except KeyFileError as exc:  # the operator key store cannot be trusted or read
                return page(request, "message.html", None, 503, title="Key store unavailable", message=str(exc))
            except (AuditStoreError, LedgerError) as exc:  # the access log (or the bucket) cannot be written
                return page(request, "message.html", None, 503, title="Unavailable", message=f"not done: {exc}")
            except forms.FormError as exc:
                return page(request, "message.html", None, 400, title="Bad input", message=str(exc))

        return run

    async def login_form(request: Request) -> Response:
        token = new_token()
        back = forms.next_path(request.query_params.get("next"))
        response = page(request, "login.html", None, login_csrf=token, error=None, next_path=back)
        response.set_cookie(LOGIN_CSRF_COOKIE, token, httponly=True, samesite="strict", secure=console.secure_cookie,
                            max_age=3600, path="/login")  # fmt: skip
        return response

    async def login(request: Request) -> Response:
        values = await read_form(request)
        expected = request.cookies.get(LOGIN_CSRF_COOKIE) or ""
        if not expected or not same_token(values.get("csrf"), expected):
            await run_in_threadpool(console.log, request, "login", "console", None, None, "missing or wrong CSRF token")
            raise Refused(403, "refused: the login form's CSRF token is missing or wrong (reload the page)")
        keys = await run_in_threadpool(console.keys)
        operator = keys.prove(values.get("token", "").strip()) if keys is not None else None
        why = None
        if keys is None:
            why = "no operator key store is configured (REPROLANE_OPERATOR_KEYS_PATH)"
        elif operator is None:
            why = "the key is not in the key store (unknown, revoked or mistyped)"
        elif not operator.may(SESSION_ROLE):
            why = f"operator key {operator.key_id!r} has no role that grants {SESSION_ROLE!r} (viewer, hold-admin)"
        await run_in_threadpool(console.log, request, "login", "console", operator, None, why)
        back = forms.next_path(values.get("next"))
        if why is not None:
            return page(request, "login.html", None, 401, login_csrf=expected, error=why, next_path=back)
        assert operator is not None
        sid, _ = console.sessions.open(operator)
        response = RedirectResponse(back or "/search", status_code=303)
        response.set_cookie(SESSION_COOKIE, sid, httponly=True, samesite="strict", secure=console.secure_cookie,
                            path="/")  # fmt: skip
        response.delete_cookie(LOGIN_CSRF_COOKIE, path="/login")
        return response

    async def logout(request: Request) -> Response:
        values = await read_form(request)
        session = await run_in_threadpool(console.gate, request, "logout", "console")
        await console.check_csrf(request, session, values, "logout", "console")
        console.sessions.close(request.cookies.get(SESSION_COOKIE))
        await run_in_threadpool(console.log, request, "logout", "console", session.operator)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    async def search(request: Request) -> Response:
        values = dict(request.query_params)
        filters = forms.filters(values)
        page_no = forms.page(values)
        target = filters.describe()
        session = await run_in_threadpool(console.gate, request, "search", target, filters.tenant)
        scope = session.operator.tenant
        found, problem, searched = None, None, forms.searched(values)
        if searched:
            await run_in_threadpool(console.log, request, "search", target, session.operator, scope or filters.tenant)
            try:
                found = await run_in_threadpool(console.records.search, filters, scope, page_no, console.search_limit)
            except SEARCH_ERRORS as exc:
                problem = str(exc)
        links = {}
        if found is not None:
            if found.page > 1:
                links["prev"] = "/search?" + forms.search_query(values, min(found.page - 1, found.pages))
            if found.page < found.pages:
                links["next"] = "/search?" + forms.search_query(values, found.page + 1)
        return page(request, "search.html", session, values=values, found=found, searched=searched,
                    unfiltered=filters.empty(), links=links, problem=problem, verdicts=forms.VERDICTS)  # fmt: skip

    def _request_id(request: Request) -> str:
        rid = forms.an_id(str(request.path_params["request_id"]), "request id")
        assert rid is not None
        return rid

    async def not_visible(request: Request, session: Session, action: OperatorAction, target: str) -> NoReturn:
        """Another tenant's record is answered as no record at all: logged, then 404."""
        await run_in_threadpool(console.log, request, action, target, session.operator, session.operator.tenant,
                                "no such record in the operator's scope")  # fmt: skip
        raise Refused(404, f"no record {target} that you may see", session)

    async def visible_envelope(request: Request, session: Session, action: OperatorAction, rid: str) -> Envelope:
        """The envelope of `rid` when the session may see it, the action logged as allowed (`not_visible` else)."""
        try:
            envelope = await run_in_threadpool(console.records.envelope, rid, session.operator.tenant)
        except NotVisible:
            await not_visible(request, session, action, rid)
        await run_in_threadpool(console.log, request, action, rid, session.operator, envelope.tenant)
        return envelope

    async def request_page(request: Request, notice: str | None = None) -> Response:
        rid = _request_id(request)
        notice = notice or forms.DONE.get(request.query_params.get("done", ""))
        session = await run_in_threadpool(console.gate, request, "view.request", rid)
        try:
            record = await run_in_threadpool(console.records.request, rid, session.operator.tenant)
        except NotVisible:
            await not_visible(request, session, "view.request", rid)
        await run_in_threadpool(console.log, request, "view.request", rid, session.operator, record.envelope.tenant)
        env = record.envelope
        decoder = decoder_for(console.decoder, env.artifacts.tokenizer_sha256)
        prompt_text = env.prompt.text if env.prompt is not None else None
        if prompt_text is None and env.prompt is not None and decoder is not None:
            prompt_text = decoder.decode(env.prompt.token_ids)
        spell = decoder.spell if decoder else None
        views = [replay_view(env, r, spell) for r in record.results]
        plots = [charts.logprob_diff_chart(v.positions, v.logprob_diffs, v.fork) for v in views]
        shadow = shadow_view(env, record.shadow, console.thresholds, spell) if record.shadow is not None else None
        shadow_plot = (
            charts.logprob_diff_chart(shadow.positions, shadow.logprob_diffs, shadow.fork)
            if shadow is not None and shadow.positions
            else None
        )
        return page(
            request, "request.html", session, record=record, env=env, prompt_text=prompt_text,
            decoded=decoder is not None and (env.prompt is None or env.prompt.text is None),
            choice=recorded_choice(record.envelope), replays=list(zip(views, plots, strict=True)),
            may_hold=session.operator.may("hold-admin"), replay=console.replay, replay_off=NO_KEY,
            evidence=console.records.signer, notice=notice, shadow=shadow, shadow_plot=shadow_plot,
        )  # fmt: skip

    async def show_request(request: Request) -> Response:
        return await request_page(request)

    async def hold(request: Request) -> Response:
        """Place or lift the legal hold (hold-admin), with a reason and/or case number and a confirmation; then
        back to the record's page by a redirect (a reload shows the page, it does not post the form again)."""
        rid = _request_id(request)
        values = await read_form(request)
        action: OperatorAction = "hold.add" if values.get("action") == "add" else "hold.remove"
        session = await run_in_threadpool(console.gate, request, action, rid)
        await console.check_csrf(request, session, values, action, rid)
        asked = forms.hold_form(values)
        try:
            envelope = await run_in_threadpool(console.records.envelope, rid, session.operator.tenant)
        except NotVisible:
            await not_visible(request, session, action, rid)
        await run_in_threadpool(functools.partial(
            console.log, request, action, rid, session.operator, envelope.tenant, note=asked.reason, case=asked.case,
            held_envelopes=(envelope.envelope_id(),)))  # fmt: skip
        await run_in_threadpool(console.records.set_hold, envelope, asked.on)
        done = "hold-placed" if asked.on else "hold-lifted"
        return RedirectResponse(f"/requests/{quote(rid)}?done={done}#legal-hold", status_code=303)

    async def replay(request: Request) -> Response:
        rid = _request_id(request)
        values = await read_form(request)
        session = await run_in_threadpool(console.gate, request, "replay.request", rid)
        await console.check_csrf(request, session, values, "replay.request", rid)
        if console.replay is None:
            raise Refused(409, f"not replayed: {NO_KEY}", session)
        envelope = await visible_envelope(request, session, "replay.request", rid)
        try:
            answer = await run_in_threadpool(console.replay.replay, envelope, console.records.store)
        except ReplayNowError as exc:
            return await request_page(request, notice=f"not replayed: {exc}")
        return await request_page(request, notice=answer)

    async def evidence(request: Request) -> Response:
        rid = _request_id(request)
        session = await run_in_threadpool(console.gate, request, "evidence.download", rid)
        envelope = await visible_envelope(request, session, "evidence.download", rid)
        try:
            bundle = await run_in_threadpool(console.records.evidence, envelope)
        except AuditStoreError:
            raise
        except AuditError as exc:  # no signing key, no checkpoint covering it yet, a record that does not verify
            return page(request, "message.html", session, 409, title="No evidence bundle", message=str(exc))
        name = "evidence-" + "".join(c if c.isalnum() or c in "-." else "_" for c in rid) + ".zip"
        return Response(bundle, media_type="application/zip",
                        headers={"content-disposition": f'attachment; filename="{name}"'})  # fmt: skip

    async def workflow(request: Request) -> Response:
        wid = forms.an_id(str(request.path_params["workflow_id"]), "workflow id")
        tenant = forms.an_id(request.query_params.get("tenant") or None, "tenant")
        assert wid is not None
        session = await run_in_threadpool(console.gate, request, "view.workflow", wid, tenant)
        try:
            steps = await run_in_threadpool(console.records.workflow, wid, tenant, session.operator.tenant)
        except NotVisible:
            await not_visible(request, session, "view.workflow", wid)
        except READ_ERRORS as exc:
            return page(request, "message.html", session, 409, title="Workflow", message=str(exc))
        await run_in_threadpool(console.log, request, "view.workflow", wid, session.operator, steps[0].envelope.tenant)
        first = next((i for i, s in enumerate(steps) if s.diverged), None)
        return page(request, "workflow.html", session, workflow_id=wid, steps=steps, first_divergent=first)

    async def overview(request: Request) -> Response:
        session = await run_in_threadpool(console.gate, request, "view.overview", "overview")
        await run_in_threadpool(console.log, request, "view.overview", "overview", session.operator,
                                session.operator.tenant)  # fmt: skip
        data = await run_in_threadpool(console.records.overview, session.operator.tenant)
        gates = list(reversed(data.gate_runs))
        figures = {
            "rate": charts.divergence_rate_chart(data.by_runtime),
            "positions": charts.position_histogram(data.positions, data.replays),
            "lag": charts.lag_histogram(data.lags_s),
            "verified": charts.verified_chart(data.verified),
            "lag_over_time": charts.lag_chart(data.verified),
            "gates": charts.gate_chart(
                [
                    (f"{n}. {g.finished_at:%Y-%m-%d %H:%M:%S}", g.pass_rate or 0.0, g.gate_passed)
                    for n, g in enumerate(gates, start=1)
                ]
            ),
        }
        return page(request, "overview.html", session, data=data, figures=figures)

    async def home(request: Request) -> Response:
        return RedirectResponse("/search", status_code=303)

    async def plotly_js(request: Request) -> Response:
        return FileResponse(charts.plotly_js(), media_type="text/javascript")

    async def healthz(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    static = Path(str(resources.files("infra.console") / "static"))
    routes = [
        Route("/", home),
        Route("/healthz", healthz),
        Route("/login", handled(login_form), methods=["GET"]),
        Route("/login", handled(login), methods=["POST"]),
        Route("/logout", handled(logout), methods=["POST"]),
        Route("/search", handled(search)),
        Route("/requests/{request_id}", handled(show_request), methods=["GET"]),
        Route("/requests/{request_id}/hold", handled(hold), methods=["POST"]),
        Route("/requests/{request_id}/replay", handled(replay), methods=["POST"]),
        Route("/requests/{request_id}/evidence", handled(evidence), methods=["GET"]),
        Route("/workflows/{workflow_id}", handled(workflow), methods=["GET"]),
        Route("/overview", handled(overview)),
        Route("/static/plotly.min.js", plotly_js),
        Mount("/static", StaticFiles(directory=str(static)), name="static"),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(_SecurityHeaders)
    return app


class _SecurityHeaders:
    """`HEADERS` on every response (pages, static files, redirects), unless the response set its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                headers += [(k.encode(), v.encode()) for k, v in HEADERS.items() if k.encode() not in present]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)
