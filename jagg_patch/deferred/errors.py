"""The deferred proxy's one error: a call or a flush it cannot serve, said in one line."""


class DeferredError(RuntimeError):
    """The deferred JAGG update cannot go on: the line says why and what to change."""
