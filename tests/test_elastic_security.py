"""The scheduler's API against a real server on loopback: authentication, bad bodies, fuzzing, secrets."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, given, settings

from jabascli.elastic.job import Scheduler
from jabascli.elastic.protocol import TrainerEvent, finite_only
from jabascli.elastic.service import OPEN_ROUTES, create_app
from jabascli.elastic.token import TOKEN_ENV, load_token, read_token_file, write_token
from jabascli.errors import InputError
from tests.elastic_support import TOKEN, auth, load, serving, write_config

SRC = Path(__file__).resolve().parents[1] / "src"


def every_route(tmp_path: Path) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, the schema included: enumerated, not listed."""
    app = create_app(Scheduler(load(write_config(tmp_path))), TOKEN)
    routes = []
    for route in app.routes:
        methods = route.methods if isinstance(route, APIRoute) else getattr(route, "methods", None) or {"GET"}
        for method in sorted(methods - {"HEAD"}):
            routes.append((method, route.path.replace("{rank}", "0")))  # type: ignore[attr-defined]
    return routes


def test_every_route_but_healthz_needs_the_token(tmp_path: Path) -> None:
    routes = every_route(tmp_path)
    assert ("GET", "/openapi.json") in routes and len(routes) >= 7
    with serving(load(write_config(tmp_path))) as (url, _):
        for method, path in routes:
            expected_open = (method, path) in OPEN_ROUTES
            for headers in ({}, auth("wrong-token-0123456789"), {"Authorization": TOKEN}, {"Authorization": "Basic x"}):
                r = httpx.request(method, url + path, headers=headers, json={})
                if expected_open:
                    assert r.status_code == 200, (method, path)
                else:
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/no/such/route").status_code == 401  # unknown paths say nothing either
        assert httpx.get(url + "/openapi.json", headers=auth()).status_code == 200


def test_malformed_bodies_get_422_without_a_traceback(tmp_path: Path) -> None:
    with serving(load(write_config(tmp_path))) as (url, scheduler):
        bad = [
            ("/v1/workers", b"{not json"),
            ("/v1/workers", b'{"rank": -1, "host": "h", "devices": {}}'),
            ("/v1/workers", b'{"rank": "x", "host": 3}'),
            ("/v1/workers/0/heartbeat", b'{"events": "many"}'),
            ("/v1/job/move", b'{"servers": []}'),
            ("/v1/job/move", b'{"servers": ["A"], "when": "tomorrow"}'),
            ("/v1/job/move", b'{"servers": ["A"], "extra": 1}'),
            ("/v1/job/stop", b"[]"),
        ]
        for path, body in bad:
            r = httpx.post(url + path, content=body, headers={**auth(), "Content-Type": "application/json"})
            assert r.status_code == 422, (path, body, r.status_code, r.text)
            assert "Traceback" not in r.text and 'File "' not in r.text
        r = httpx.post(url + "/v1/job/move", json={"servers": ["A", "nowhere"]}, headers=auth())
        assert r.status_code == 422 and "unknown server 'nowhere'" in r.text
        assert scheduler.state == "waiting" and scheduler.allocation == ["A"]  # nothing disturbed


POST_ROUTES = ["/v1/workers", "/v1/workers/0/heartbeat", "/v1/job/move", "/v1/job/stop"]


def test_non_finite_numbers_and_huge_bodies_get_422_and_413_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    json_headers = {**auth(), "Content-Type": "application/json"}
    huge = b'{"servers": ["' + b"A" * 5_000_000 + b'"]}'  # 5 MB

    def streamed() -> Iterator[bytes]:  # no Content-Length: the limit must count what arrives
        for start in range(0, len(huge), 65536):
            yield huge[start : start + 65536]

    with caplog.at_level(logging.WARNING), serving(load(write_config(tmp_path))) as (url, scheduler):
        for path in POST_ROUTES:
            for body in (b"1e999999", b'{"rank": 1e999999}', b'{"when": NaN}', b"[Infinity]"):
                r = httpx.post(url + path, content=body, headers=json_headers)
                assert r.status_code == 422, (path, body, r.status_code, r.text)
            beat = {"events": [{"generation": 1, "event": {"event": "step", "loss": 1e999999}}]}
            r = httpx.post(url + "/v1/workers/0/heartbeat", content=json.dumps(beat), headers=json_headers)
            assert r.status_code == 422 and "non-finite" in r.text
            for content in (huge, streamed()):
                r = httpx.post(url + path, content=content, headers=json_headers, timeout=30)
                assert r.status_code == 413 and "max_body_bytes" in r.text, (path, r.status_code)
        # A body under the limit that fails validation is not echoed back: an excerpt at most.
        big_name = b'{"servers": ["' + b"B" * 900_000 + b'"]}'
        r = httpx.post(url + "/v1/job/move", content=big_name, headers=json_headers)
        assert r.status_code == 422 and len(r.content) < 2000, len(r.content)
        assert scheduler.state == "waiting" and scheduler.workers == {}  # nothing disturbed
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []
    assert "Traceback" not in caplog.text


def test_agents_send_a_nan_loss_as_null() -> None:
    event = {"event": "step", "loss": float("nan"), "nested": [{"x": float("inf")}], "step": 3}
    assert finite_only(event) == {"event": "step", "loss": None, "nested": [{"x": None}], "step": 3}
    TrainerEvent(generation=1, event=finite_only(event))  # accepted as sent


def test_fuzzing_the_openapi_schema_with_the_token_finds_no_server_error(tmp_path: Path) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    with serving(load(write_config(tmp_path))) as (url, _):
        raw = httpx.get(url + "/openapi.json", headers=auth()).json()
        schema = schemathesis.openapi.from_dict(raw)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 6
        session = httpx.Client(base_url=url, headers=auth())
        sent: list[int] = []
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def no_5xx(case: object) -> None:
                kwargs = case.as_transport_kwargs(base_url=url)  # type: ignore[attr-defined]
                r = session.request(
                    kwargs["method"], kwargs["url"], json=kwargs.get("json"), params=kwargs.get("params")
                )
                sent.append(r.status_code)
                assert r.status_code < 500, (kwargs, r.status_code, r.text)
                assert "Traceback" not in r.text

            no_5xx()
        assert len(sent) >= 5 * len(operations) and 200 in sent and 422 in sent


def test_a_token_file_open_to_others_is_refused_and_a_new_one_is_private(tmp_path: Path) -> None:
    path = tmp_path / "token"
    token = write_token(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_token_file(path) == token
    os.chmod(path, 0o644)
    with pytest.raises(InputError, match="open to group or others"):
        read_token_file(path)
    os.chmod(path, 0o640)
    with pytest.raises(InputError, match="chmod 600"):
        read_token_file(path)
    loaded = load(write_config(tmp_path, scheduler={"token_file": str(path)}))
    os.chmod(path, 0o600)
    assert load_token(loaded, environ={}) == token
    assert load_token(loaded, environ={TOKEN_ENV: "from-the-environment-123"}) == "from-the-environment-123"
    with pytest.raises(InputError, match="at least 16"):
        load_token(loaded, environ={TOKEN_ENV: "short"})


def test_the_token_cli_writes_a_private_file(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    from jabascli.cli.app import app

    result = cli.invoke(app, ["token", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output
    assert os.stat(tmp_path / "t").st_mode & 0o777 == 0o600
    os.chmod(tmp_path / "t", 0o604)
    config = write_config(tmp_path, scheduler={"token_file": str(tmp_path / "t")})
    result = cli.invoke(app, ["schedule", "-c", str(config)], env={TOKEN_ENV: ""})
    assert result.exit_code == 2 and "open to group or others" in result.output


def offenders(source: str, where: str) -> list[str]:
    """Calls that run a shell or unpickle bytes: shell=..., os.system/popen/exec*, pickle loads, unsafe torch.load."""
    found = []
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "dill", "marshal"):
            found.append(f"{where}:{node.lineno}: from {node.module} import")
        if not isinstance(node, ast.Call):
            continue
        name, at = ast.unparse(node.func), f"{where}:{node.lineno}"
        if name in ("os.system", "os.popen") or name.startswith(("os.exec", "os.spawn")):
            found.append(f"{at}: {name}")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{at}: shell={ast.unparse(kw.value)}")
        if re.fullmatch(r"(pickle|cPickle|_pickle|dill|marshal)\.(loads?|Unpickler)", name):
            found.append(f"{at}: {name}")
        if name == "torch.load":
            safe = [kw for kw in node.keywords if kw.arg == "weights_only"]
            if not (safe and isinstance(safe[0].value, ast.Constant) and safe[0].value.value is True):
                found.append(f"{at}: torch.load without weights_only=True")
    return found


def test_no_shell_no_os_system_no_unpickling_of_received_bytes_in_src() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        found += offenders(path.read_text(), str(path.relative_to(SRC)))
    assert found == []


def test_the_source_scan_catches_what_it_looks_for() -> None:
    bad = [
        "import os\nos.system('ls')",
        "import subprocess\nsubprocess.run('ls', shell=True)",
        "import subprocess\nsubprocess.Popen(['ls'], shell=flag)",
        "import pickle\npickle.loads(data)",
        "from pickle import loads",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "import os\nos.execvp('sh', ['sh'])",
    ]
    for source in bad:
        assert offenders(source, "x.py"), source
    fine = "import subprocess, torch\nsubprocess.run(['ls'], shell=False)\ntorch.load(f, weights_only=True)"
    assert offenders(fine, "x.py") == []
