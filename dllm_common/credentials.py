"""Credentials for a team's Prefect and MLflow servers (docs/operations.md, "Credentials").

One source serves the servers (`make server`) and their clients (workers, `make deploy`, `dllm-flow`):
DLLM_SERVER_USER + DLLM_SERVER_PASSWORD, or DLLM_SERVER_AUTH_FILE holding one line `USER:PASSWORD` (a file
outside the repository, mode 0600). Never the pipeline's config, which is committed and recorded in MLflow.
A client turns them into what Prefect's and MLflow's own clients read: PREFECT_API_AUTH_STRING, and
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (values already set there win).

    python -m dllm_common.credentials server      # prints USER:PASSWORD, or nothing when no credentials are set
    python -m dllm_common.credentials exec CMD..  # runs CMD with the clients' variables set
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from dllm_common.config import ConfigError

USER, PASSWORD, FILE = "DLLM_SERVER_USER", "DLLM_SERVER_PASSWORD", "DLLM_SERVER_AUTH_FILE"
# MLflow's basic-auth app refuses a shorter admin password (it dies at start with a traceback): docs/operations.md
MIN_SERVER_PASSWORD = 12


def read(env: MutableMapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(user, password) from the environment or the file it names; None when neither is set."""
    if env.get(FILE):
        path = Path(env[FILE]).expanduser()
        try:
            line = next(iter(path.read_text().splitlines()), "")
        except OSError as exc:
            raise ConfigError(
                f"{FILE}={path} cannot be read ({exc.strerror}); point it at a USER:PASSWORD file"
            ) from None
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:  # like ssh with a private key: a password others can read is refused, not used
            raise ConfigError(
                f"{FILE}={path} is open to group or others (mode {mode:04o}) and holds the server's password; "
                f"chmod 600 {path}"
            )
        user, _, password = line.strip().partition(":")
        where = f"the first line of {FILE} ({path})"
    elif env.get(USER) or env.get(PASSWORD):
        user, password = env.get(USER, ""), env.get(PASSWORD, "")
        where = f"{USER} and {PASSWORD}"
    else:
        return None
    if not user or not password:
        raise ConfigError(f"the server credentials need a user and a password: set both, as USER:PASSWORD in {where}")
    return user, password


def apply_to_client(env: MutableMapping[str, str] = os.environ) -> bool:
    """Set Prefect's and MLflow's client variables from our credentials (not overriding ones already set)."""
    creds = read(env)
    if creds is None:
        return False
    user, password = creds
    env.setdefault("PREFECT_API_AUTH_STRING", f"{user}:{password}")
    env.setdefault("MLFLOW_TRACKING_USERNAME", user)
    env.setdefault("MLFLOW_TRACKING_PASSWORD", password)
    return True


def for_server(env: MutableMapping[str, str] = os.environ) -> tuple[str, str] | None:
    """The credentials `make server` starts both servers with (`read`), refused unless MLflow will take them."""
    creds = read(env)
    if creds and len(creds[1]) < MIN_SERVER_PASSWORD:
        raise ConfigError(
            f"the server password has {len(creds[1])} characters; MLflow's login needs at least "
            f"{MIN_SERVER_PASSWORD}: choose a longer one (e.g. openssl rand -base64 18)"
        )
    return creds


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["server"]:
            creds = for_server()
            if creds:
                print(":".join(creds))
            return 0
        if argv[:1] == ["exec"] and len(argv) > 1:
            apply_to_client()
            os.execvp(argv[1], argv[1:])
    except ConfigError as exc:
        print(f"dllm-flow: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(__doc__.strip().splitlines()[-2:]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
