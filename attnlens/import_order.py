"""Imported first by attnlens: nnsight, imported after, mounts `.save` on every object, which anyio refuses on classes
it defines after that; anyio's asyncio backend loads on first use (an HTTP server's first streamed response), so it
is loaded here first. Where nnsight came first (a Ray worker of vLLM's Ray executor loads it before attnlens),
`.save` is unmounted for that import."""

import contextlib
import sys


def _anyio_before_nnsights_save() -> None:
    nnsight = sys.modules.get("nnsight")
    mounted = nnsight is not None and hasattr(object(), "save")
    with contextlib.suppress(ImportError):
        if mounted:
            from nnsight import _c

            _c.unmount("save")
        try:
            import anyio._backends._asyncio  # noqa: F401
        finally:
            if mounted:
                _c.mount(nnsight.save, "save")


_anyio_before_nnsights_save()
