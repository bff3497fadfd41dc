"""attnlens: one vocabulary for the inside of attention, on every model family."""

from .editing import keep_masked, masked
from .errors import (AttnlensError, EditError, LocationDrift, OrderError, Unavailable, UnknownFamily,
                     UnknownFamilyWarning)
from .family import Family, family_for, register, registered
from .locations import Derived, Location, ModuleInput, ModuleOutput, Operation, OutputField
from .standardized import StandardizedTransformer
from .support import Support
from .values import ALL_VALUES, Value

from . import models  # noqa: E402  (after StandardizedTransformer, which it builds)

__all__ = [
    "ALL_VALUES", "AttnlensError", "Derived", "EditError", "Family", "Location", "LocationDrift", "ModuleInput",
    "ModuleOutput", "Operation", "OutputField", "OrderError", "StandardizedTransformer", "Support", "Unavailable", "UnknownFamily",
    "UnknownFamilyWarning",    "Value", "family_for", "keep_masked", "masked", "models", "register", "registered",
]
