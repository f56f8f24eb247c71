"""Errors the engine raises for things a user caused; the server maps them to OpenAI-shaped 4xx."""


class RequestRejected(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineOverloaded(RuntimeError):
    def __init__(self, retry_after_s: float = 1.0, message: str = "the server is busy; retry later"):
        super().__init__(message)
        self.retry_after_s = retry_after_s
