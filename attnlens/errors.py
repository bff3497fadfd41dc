"""The errors attnlens raises: types a user can catch, messages that say what to do next."""


class AttnlensError(Exception):
    """Base class of attnlens's own errors."""


class Unavailable(AttnlensError):
    """A standardized value that cannot be read on this model, layer or engine; the message says why."""


class OrderError(AttnlensError):
    """Values were read in an order the forward pass cannot serve; the message names both values."""


class OutsideTrace(AttnlensError):
    """A value was read or written outside a trace, where no forward pass runs to hold it."""


class LocationDrift(AttnlensError):
    """A family's recorded location no longer matches the installed transformers: the value would be wrong."""


class Miswired(LocationDrift):
    """A family disagrees with the model it loads (a module path, a size, a value's layout or an identity between its
    values), found when the model loads: served, the values would be wrong. The message names the family, what it
    states, what was expected and found, and what to check."""


class EngineStopped(AttnlensError, RuntimeError):
    """The vLLM engine stopped under a run (a worker process or a Ray node died): nothing of the run's batch in flight
    was kept, and a resumable run (`attnlens.collect`) goes on from its last commit when started again."""


class UnknownFamily(AttnlensError):
    """No attnlens family is registered for this model type."""


class UnknownFamilyWarning(UserWarning):
    """A model loaded without a family: only the block inputs and outputs, embeddings and logits are served."""


class InferredFamilyWarning(UserWarning):
    """A model loaded without a registered family, served by the common layout inferred from its structure and
    verified (`attnlens.inferred`); the message prints the family to register."""


class EditError(AttnlensError):
    """An edit that cannot land where it was written; the message says how to write it instead."""
