"""The launcher's own agent (``mct.run.agent``) and its checks apart (``mct.run.apart``),
with stand-in workers (a few lines of Python, no torch): torchrun's environment, a failed
group restarted while ``--max-restarts`` allows, a final exit code or a signal ending it,
survivors of a failed group stopped; the checks' answer and errors through a fork."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from mct.run.agent import LocalGroup
from mct.run.launch import launch_env

REPO = Path(__file__).resolve().parents[2]


def _group(tmp_path: Path, body: str, nproc: int = 2, max_restarts: int = 0) -> LocalGroup:
    """A group whose workers run ``body`` (Python; ``env`` is os.environ, ``d`` the launch dir)."""
    script = tmp_path / "worker.py"
    script.write_text("import json, os, sys, time\nfrom pathlib import Path\nenv = os.environ\n"
                      "d = Path(env['MCT_LAUNCH_DIR'])\n" + textwrap.dedent(body))
    d = tmp_path / "launch"
    d.mkdir()
    return LocalGroup([sys.executable, str(script)], nproc, max_restarts, launch_env(str(d), nproc), d)


def _stopped() -> dict:
    return {"signum": 0, "at": 0.0}


def test_workers_get_torchruns_environment_and_a_fresh_store_port(tmp_path):
    group = _group(tmp_path, """
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "MCT_LAUNCHER_PID")
        (d / f"env.{env['RANK']}").write_text(json.dumps({k: env.get(k) for k in keys}))
    """)
    assert group.run(_stopped()) == 0
    envs = [json.loads((group.dir / f"env.{r}").read_text()) for r in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == \
        [("0", "0", "2", "2"), ("1", "1", "2", "2")]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0
    assert envs[0]["TORCHELASTIC_RUN_ID"] == envs[1]["TORCHELASTIC_RUN_ID"]
    assert (envs[0]["TORCHELASTIC_RESTART_COUNT"], envs[0]["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0")
    assert envs[0]["MCT_LAUNCHER_PID"] == str(os.getpid())


def test_a_failed_group_is_restarted_with_the_count_one_higher(tmp_path):
    group = _group(tmp_path, """
        restart = int(env["TORCHELASTIC_RESTART_COUNT"])
        (d / f"ran.{restart}.{env['RANK']}").write_text("")
        if restart == 0 and env["RANK"] == "1":
            os.kill(os.getpid(), 9)
        if restart == 0:
            time.sleep(60)  # rank 0 of the failed attempt: stopped by the agent's SIGTERM
    """, max_restarts=1)
    assert group.run(_stopped()) == 0
    assert sorted(f.name for f in group.dir.glob("ran.*")) == ["ran.0.0", "ran.0.1", "ran.1.0", "ran.1.1"]
    assert (group.dir / "agent.log").read_text() == (
        "mct: worker rank 0 (restart 0) was killed by SIGTERM\nmct: worker rank 1 (restart 0) was killed by SIGKILL\n")


def test_no_restart_left_fails_the_group_and_names_the_worker(tmp_path):
    group = _group(tmp_path, "sys.exit(7 if env['RANK'] == '1' else 0)")
    assert group.run(_stopped()) == 1
    assert (group.dir / "agent.log").read_text() == "mct: worker rank 1 (restart 0) exited with code 7\n"


def test_a_final_exit_code_is_not_restarted(tmp_path):
    group = _group(tmp_path, """
        restart = env["TORCHELASTIC_RESTART_COUNT"]
        (d / f"exit.{restart}.{env['RANK']}").write_text(json.dumps(
            {"code": 2, "line": "mct: error: x", "restart": int(restart), "rank": int(env["RANK"])}))
        sys.exit(2)
    """, max_restarts=3)
    assert group.run(_stopped()) == 1
    assert "restart 1" not in (group.dir / "agent.log").read_text()


def test_a_forwarded_signal_stops_restarts(tmp_path):
    group = _group(tmp_path, "sys.exit(143)", max_restarts=3)
    assert group.run({"signum": signal.SIGTERM, "at": 1e18}) == 1
    assert "restart 1" not in (group.dir / "agent.log").read_text()


def _apart(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-c", "import os, sys\nfrom mct.run.apart import apart\n" + code],
                          env=env, capture_output=True, text=True, timeout=60)


def test_checks_apart_run_in_a_child_and_return_its_answer():
    out = _apart("print(apart(lambda: [os.getpid(), sys.modules.get('json') is not None]) [0] != os.getpid())\n"
                 "apart(lambda: __import__('torch') and None)\nprint('torch' in sys.modules)")
    assert out.stdout.split() == ["True", "False"], out.stderr


def test_checks_apart_raise_a_childs_user_error_here_as_value_error():
    out = _apart("def bad():\n    raise ValueError('data.path = x does not exist')\n"
                 "try:\n    apart(bad)\nexcept ValueError as e:\n    print('caught', e)\n"
                 "try:\n    apart(lambda: open('/nonexistent/file'))\nexcept ValueError as e:\n    print('os', e)")
    lines = out.stdout.splitlines()
    assert lines[0] == "caught data.path = x does not exist", out.stderr
    assert lines[1].startswith("os ") and "/nonexistent/file" in lines[1], out.stdout
