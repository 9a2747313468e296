"""Our standard output as a pipe's writer: `vring dump ... | head` and `vring demo | head -1` are no error."""
import os
import sys


class StdoutClosed(Exception):
    """Whoever reads our output closed it."""


def out(what):
    """Print ``what`` (text, or a function that prints) and flush: a closed stdout is StdoutClosed (only ours:
    the EPIPE of a socket raised while ``what`` runs is a BrokenPipeError too, so callers keep sockets out)."""
    try:
        what() if callable(what) else print(what)
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed() from None


def closed_quietly():
    """After StdoutClosed: exit status 0 with no second error when the interpreter flushes stdout at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
