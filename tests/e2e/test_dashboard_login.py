"""The dashboard of a coordinator that requires a token, in a real headless Chromium: the
page asks for the token, refuses a wrong one, and with the right one (a read-only token,
which the dashboard also uses to read the coordinator over TLS) shows the live run; the
token never appears in the page nor in its cookie (a session id), and signing out ends
the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.server import DashboardServer
from ripples.server_security import ServerSecurity
from tests.pki import READ_TOKEN, TOKEN, Pki, make_pki

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def secured_dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    pki: Pki = make_pki(tmp_path)
    coordinator = CoordinatorServer(ServerConfig(
        host="127.0.0.1", port=0, run=RunSettings.build(num_workers=2, task="digits"),
        security=ServerSecurity(token=TOKEN, read_token=READ_TOKEN,
                                cert_file=str(pki.server_cert), key_file=str(pki.server_key))))
    coordinator.start()
    # What `ripples dashboard serve --token-file read.token --tls-ca ca.pem` exports.
    monkeypatch.setenv("RIPPLES_TOKEN", READ_TOKEN)
    monkeypatch.setenv("RIPPLES_TLS_CA", str(pki.ca))
    dashboard = DashboardServer(DashboardConfig(
        coordinator=f"127.0.0.1:{coordinator.port}", port=0)).start()
    try:
        yield dashboard.url
    finally:
        dashboard.stop()
        coordinator.stop()


def test_the_dashboard_asks_for_the_token_and_then_shows_the_run(
        chromium: tuple[ModuleType, str], secured_dashboard: str) -> None:
    sync_api, chromium_path = chromium
    url = secured_dashboard
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, headless=True,
                                    args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url)
            assert page.url.endswith("/login")  # sent to the form, not to the data
            assert page.evaluate("fetch('/api/status').then(r => r.status)") == 401
            page.fill("input[name=token]", "not-the-token")
            page.click("button")
            page.wait_for_selector("[role=alert]")
            assert "Wrong token" in page.content()
            page.fill("input[name=token]", READ_TOKEN)
            page.click("button")
            page.wait_for_url(url)
            # The run, read from the coordinator over TLS with the read-only token.
            page.wait_for_function(
                "fetch('/api/status').then(r => r.json()).then(s => s.connected === true)",
                timeout=30_000)
            page.wait_for_selector("#run-info")
            assert READ_TOKEN not in page.content() and TOKEN not in page.content()
            cookie = next(c for c in page.context.cookies() if c["name"] == "ripples_session")
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            assert READ_TOKEN not in cookie["value"]  # a session id, not the token
            # Signing out ends the session: the page asks for the token again.
            page.click("#sign-out button")
            page.wait_for_url(url + "login")
            assert page.evaluate("fetch('/api/status').then(r => r.status)") == 401
        finally:
            browser.close()
