"""The shared secret of a run over several machines: the store they meet at (node 0's
launcher's, or a `zerocc rendezvous`) listens on every address of its machine, and torch's
``TCPStore`` has no authentication (neither has torchrun: nothing of its to follow). Where
``ZEROCC_RDZV_SECRET`` (the secret) or ``ZEROCC_RDZV_SECRET_FILE`` (a file holding it, the
``_FILE`` convention of container images' passwords) is set, the store's keeper writes a
random nonce and its HMAC under the secret (:func:`sign`), and every other launcher checks
it before it joins (:func:`check`): one started without the secret, or with another, stops
with an error naming it instead of joining another run. The secret itself never travels.

What it is not: access control. Anyone who reaches the port can still read and write the
store with torch's client; on a network that is not the run's own, keep the port behind a
firewall (docs/gpus.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from zerocc.errors import ZeroccError

SECRET_ENV = "ZEROCC_RDZV_SECRET"  # the run's shared secret
SECRET_FILE_ENV = "ZEROCC_RDZV_SECRET_FILE"  # a file whose first line is the secret
SECRET_KEY = "zerocc/secret"  # in the store: "NONCE:HMAC" under the secret, or NO_SECRET
NO_SECRET = "none"


def shared_secret() -> bytes | None:
    """The run's shared secret, from ``ZEROCC_RDZV_SECRET`` or the file
    ``ZEROCC_RDZV_SECRET_FILE`` names (its first line); None where neither is set."""
    value, path = os.environ.get(SECRET_ENV), os.environ.get(SECRET_FILE_ENV)
    if value is not None and path is not None:
        raise ZeroccError(f"{SECRET_ENV} and {SECRET_FILE_ENV} are both set: set one of them")
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ZeroccError(f"{SECRET_FILE_ENV}={path}: cannot read it: {exc.strerror}") from None
        value = lines[0].strip() if lines else ""
        if not value:
            raise ZeroccError(f"{SECRET_FILE_ENV}={path}: its first line is empty: the secret")
    elif value is not None and not value:
        raise ZeroccError(f"{SECRET_ENV} is set but empty: give it the run's secret, or unset it")
    return None if value is None else value.encode()


def _proof(secret: bytes, nonce: str) -> str:
    return hmac.new(secret, f"zerocc rendezvous {nonce}".encode(), hashlib.sha256).hexdigest()


def sign(store: Any, secret: bytes | None) -> None:
    """Write into ``store`` (a torch ``Store``) that it is kept with ``secret``, or without
    one: a fresh nonce and its HMAC under the secret, else :data:`NO_SECRET`."""
    if secret is None:
        store.set(SECRET_KEY, NO_SECRET)
        return
    nonce = secrets.token_hex(16)
    store.set(SECRET_KEY, f"{nonce}:{_proof(secret, nonce)}")


def check(store: Any, secret: bytes | None, where: str) -> None:
    """That ``store`` (``where``, said in the error) was signed with ``secret`` (or, where
    None, without one); a ZeroccError naming the variable otherwise. A store without the key
    is an older zerocc's or not zerocc's, and is taken as kept without a secret."""
    signed = store.get(SECRET_KEY).decode() if store.check([SECRET_KEY]) else NO_SECRET
    variables = f"{SECRET_ENV} (or {SECRET_FILE_ENV})"
    if signed == NO_SECRET:
        if secret is None:
            return
        raise ZeroccError(
            f"{where} was started without a shared secret, and this launcher has one "
            f"({variables}): set the same one where the store is kept too, or unset it here"
        )
    if secret is None:
        raise ZeroccError(
            f"{where} asks for the run's shared secret, and this launcher has none: set "
            f"{variables} to the secret the store was started with"
        )
    nonce, _, proof = signed.partition(":")
    if not hmac.compare_digest(proof, _proof(secret, nonce)):
        raise ZeroccError(
            f"{where} was started with another shared secret than this launcher's "
            f"{variables}: give every machine of the run, and the store, the same one"
        )
