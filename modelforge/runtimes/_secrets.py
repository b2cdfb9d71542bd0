"""Model-server secrets (an `HF_TOKEN`, an API key) are referenced by name in the catalog, never
written there: `env_from_secrets = { HF_TOKEN = "hf_token" }` gives the server the environment
variable HF_TOKEN with the node's secret `hf_token`. The node reads its secrets once, when its
process starts, from `MODELFORGE_SECRET_<NAME>` (the name upper-cased, other characters as `_`)
or from the file `$MODELFORGE_SECRETS_DIR/<name>`. So a secret's value is never in the catalog
(nor Postgres's copy of it), in a Temporal history (deployments travel in activity inputs), in an
envelope, a repr, an error or a log line: only its name is."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from modelforge.failures import FailureClass, ModelForgeError

SECRET_ENV_PREFIX = "MODELFORGE_SECRET_"
SECRETS_DIR_ENV = "MODELFORGE_SECRETS_DIR"
SECRET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
# A configuration or environment name that looks like it holds a credential.
SECRET_LOOKING = re.compile(r"TOKEN|KEY|SECRET|PASSW(OR)?D|CREDENTIAL", re.IGNORECASE)
MAX_SECRET_BYTES = 64 * 1024


def secret_env_var(name: str) -> str:
    """The node's environment variable that holds secret `name` (`hf_token`: MODELFORGE_SECRET_HF_TOKEN)."""
    return SECRET_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", name.upper())


def reference_hint(env: str) -> str:
    secret = env.lower()
    return (
        f'reference it by name instead: env_from_secrets = {{ {env} = "{secret}" }}, resolved on the node '
        f"from {secret_env_var(secret)} or the file ${SECRETS_DIR_ENV}/{secret}"
    )


def secret_problems(runtime_config: Mapping[str, str], env_from_secrets: Mapping[str, str]) -> list[str]:
    """Catalog validation: a literal value for a secret-looking key is refused (the message names
    the key and the reference syntax, never the value); references must be well formed. Which
    runtimes take `env_from_secrets` at all is the registry's to say (catalog.py asks it)."""
    problems = []
    for key in sorted(runtime_config):
        name = key.removeprefix("env.")
        if runtime_config[key] and SECRET_LOOKING.search(name):
            problems.append(
                f"runtime_config.{key}: looks like a secret and a secret is never written in the catalog; "
                + reference_hint(name)
            )
    for env in sorted(env_from_secrets):
        secret = env_from_secrets[env]
        if not ENV_NAME.match(env):
            problems.append(f"env_from_secrets: {env[:80]!r} is not an environment variable name")
        if not isinstance(secret, str) or not SECRET_NAME.match(secret):
            problems.append(
                f"env_from_secrets.{env[:80]}: a secret name is letters, digits, '_', '.' or '-' (at most 100)"
            )
        if f"env.{env}" in runtime_config:
            problems.append(f"env_from_secrets.{env[:80]}: runtime_config.env.{env[:80]} is set too")
    return problems


class NodeSecrets:
    """The secrets this node may hand its model servers, read once at process start. Its repr
    and every error name secrets, never their values."""

    def __init__(self, values: Mapping[str, str] | None = None, source: str = "") -> None:
        self._values = dict(values or {})
        self._source = source

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NodeSecrets:
        environ = os.environ if environ is None else environ
        values: dict[str, str] = {}
        directory = environ.get(SECRETS_DIR_ENV, "")
        if directory:
            values.update(_read_directory(Path(directory)))
        for variable, value in environ.items():
            if variable.startswith(SECRET_ENV_PREFIX) and len(variable) > len(SECRET_ENV_PREFIX):
                values[variable] = value  # by variable: a reference is looked up by its variable too
        return cls(values, directory)

    def get(self, name: str) -> str | None:
        """Secret `name`: MODELFORGE_SECRET_<NAME> first, else the file <name> of the secrets directory."""
        found = self._values.get(secret_env_var(name))
        return found if found is not None else self._values.get(f"file:{name}")

    def resolve(self, env_from_secrets: Mapping[str, str]) -> dict[str, str]:
        """The environment variables a server gets; MODEL_LOAD_FAILED naming what is missing."""
        environment: dict[str, str] = {}
        for env in sorted(env_from_secrets):
            secret = env_from_secrets[env]
            value = self.get(secret)
            if value is None:
                raise ModelForgeError(
                    FailureClass.MODEL_LOAD_FAILED,
                    f"secret {secret!r} (for {env}) is not set on this node: set {secret_env_var(secret)} "
                    f"or write the file ${SECRETS_DIR_ENV}/{secret}, then restart the node worker",
                )
            environment[env] = value
        return environment

    def names(self) -> list[str]:
        return sorted(self._values)

    def __repr__(self) -> str:
        return f"NodeSecrets({len(self._values)} secrets: {', '.join(self.names())})"

    __str__ = __repr__


def _read_directory(directory: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return values  # the worker starts; a load that needs one of them says which is missing
    for entry in entries:
        if not SECRET_NAME.match(entry.name):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_SECRET_BYTES:
                continue
            raw = os.read(fd, MAX_SECRET_BYTES)
        finally:
            os.close(fd)
        values[f"file:{entry.name}"] = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    return values
