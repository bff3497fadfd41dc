"""A trace's envoys shipped to vLLM's worker once per trace, not once per invoke.

nnsight pickles each invoke's body (its worker) into its request on its own, and a body that names the model or a
module carries the envoy tree with it (hundreds of envoys: some 60 KB and 6 ms per invoke on SmolLM2, then as long
again to load in the worker). Here the client pickles the tree once per trace (`by_reference`), and while nnsight
pickles the invokes every envoy pickles as a reference into that tree (nnsight's persistent ids, which already keep
each module and the interleaver out of the payload). The worker loads a trace's tree from the first of its requests
to arrive (`Trees.arrive`), before nnsight loads their bodies, so every body of one trace reads the same envoys, as
the bodies of one trace do on the transformers engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The request's `extra_args` entry carrying its trace's tree: (the trace's name, the pickled tree).
KEY = "attnlens_envoys"
PREFIX = "attnlens-envoy:"


def _envoys(model: Any) -> dict[str, Any]:
    return dict(model.modules(names=True))


@contextmanager
def by_reference(model: Any) -> Iterator[tuple[str, bytes]]:
    """Within the block, each envoy of `model`'s tree pickles as a reference to its copy in the tree pickled here
    (yielded: the trace's name and the tree's bytes, for each request's `extra_args[KEY]`)."""
    from nnsight.intervention.serialization import dumps

    envoys = _envoys(model)
    name = uuid.uuid4().hex
    tree = dumps(envoys)  # by value: the references are set after
    for path, envoy in envoys.items():
        envoy.__dict__["_persistent_id"] = f"{PREFIX}{name}:{path}"
    try:
        yield name, tree
    finally:
        for envoy in envoys.values():
            envoy.__dict__.pop("_persistent_id", None)


class Trees:
    """The worker's side: each running trace's envoys, loaded once, resolvable by nnsight while it loads the requests'
    bodies (entries in its map of persistent ids, `objects`), dropped once none of the trace's requests is live."""

    def __init__(self, objects: dict) -> None:
        self.objects = objects  # nnsight's map: persistent id -> this worker's object
        self.requests: dict[str, set[str]] = {}  # trace -> its live requests
        self.ids: dict[str, list[str]] = {}  # trace -> the persistent ids its tree added

    def arrive(self, scheduler_output: Any) -> None:
        """Load the tree of each trace whose request arrives this step and has none loaded (before nnsight loads
        the requests' bodies)."""
        from nnsight.intervention.serialization import loads

        for data in scheduler_output.scheduled_new_reqs:
            shipped = (getattr(data.sampling_params, "extra_args", None) or {}).get(KEY)
            if shipped is None:
                continue
            name, tree = shipped
            if name not in self.requests:
                found = {f"{PREFIX}{name}:{path}": envoy for path, envoy in loads(tree, self.objects).items()}
                self.objects.update(found)
                self.ids[name] = list(found)
            self.requests.setdefault(name, set()).add(data.req_id)

    def prune(self, live: Any) -> None:
        """Drop the trees none of whose requests is in `live` (the bodies already loaded keep their envoys)."""
        live = set(live)
        for name in [name for name, requests in self.requests.items() if not requests & live]:
            del self.requests[name]
            for key in self.ids.pop(name):
                self.objects.pop(key, None)
