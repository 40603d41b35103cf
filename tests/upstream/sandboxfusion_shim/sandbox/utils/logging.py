"""The upstream conftest calls ``configure_logging()``; nothing to configure here."""


def configure_logging() -> None:
    return None
