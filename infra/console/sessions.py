"""Server-side sessions and their CSRF tokens.

A login that proves an operator key opens a session: a random 256-bit id is the only thing the browser holds
(cookie ``reprolane_session``: HttpOnly, SameSite=Strict, Path=/, Secure when the settings say so), and the
operator it maps to lives here, in the console's memory, never in the cookie. So a stolen cookie expires with
the session, a logout or a restart ends every session, and no key material reaches the browser after login.

Each session has its own CSRF token, rendered into every state-changing form (hold, replay, logout) and
compared in constant time with the submitted one; SameSite=Strict already keeps other sites' forms from
carrying the cookie, the token is the second lock. The login form, which has no session yet, uses a
double-submit token: a random cookie (``reprolane_login_csrf``) that the form must repeat.

A session ends after ``idle_s`` without a request or ``max_s`` after login, whichever comes first; at most
``max_sessions`` live at once (the oldest is dropped), so a login flood cannot grow the console's memory.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from infra.console.operators import Operator

SESSION_COOKIE = "reprolane_session"
LOGIN_CSRF_COOKIE = "reprolane_login_csrf"
_ID_BYTES = 32


@dataclass
class Session:
    operator: Operator
    csrf: str
    created: float
    seen: float = field(default=0.0)


def same_token(presented: str | None, expected: str) -> bool:
    """Constant-time equality of a presented token with the expected one (None or empty never matches)."""
    if not presented or len(presented) > 128:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "replace"), expected.encode("utf-8"))


def new_token() -> str:
    return secrets.token_urlsafe(_ID_BYTES)


class SessionStore:
    """Sessions by id, bounded in number and age (see module docstring); thread-safe."""

    def __init__(
        self,
        *,
        idle_s: float,
        max_s: float,
        max_sessions: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_s = idle_s
        self.max_s = max_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, operator: Operator) -> tuple[str, Session]:
        now = self._clock()
        sid = new_token()
        session = Session(operator, new_token(), now, now)
        with self._lock:
            self._sessions[sid] = session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return sid, session

    def get(self, sid: str | None) -> Session | None:
        """The live session of `sid` (its idle clock restarted), or None when there is none or it expired."""
        if not sid or len(sid) > 128:
            return None
        now = self._clock()
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:
                return None
            if now - session.seen > self.idle_s or now - session.created > self.max_s:
                del self._sessions[sid]
                return None
            session.seen = now
            return session

    def close(self, sid: str | None) -> None:
        if sid:
            with self._lock:
                self._sessions.pop(sid, None)
