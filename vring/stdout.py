"""Our standard streams as a pipe's writer: `vring dump ... | head`, `vring demo | head -1` and
`vring tap --decode LOG | head` are no error; a closed or failing stream never turns an exit status into a
traceback's."""
import os
import sys


class StdoutClosed(Exception):
    """Whoever reads our output closed it (or there was no stdout to begin with: `>&-`)."""


def out(what):
    """Print ``what`` (text, or a function that prints) and flush. A closed stdout is StdoutClosed (only ours:
    the EPIPE of a socket raised while ``what`` runs is a BrokenPipeError too, so callers keep sockets out);
    any other failure to write (a full disk) is an OSError that says so."""
    if sys.stdout is None:
        raise StdoutClosed()
    try:
        what() if callable(what) else print(what)
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed() from None
    except OSError as e:
        _stdout_to_devnull()   # what is still buffered would fail again at exit, as a second error
        raise OSError(f"cannot write the output: {e.strerror or e}") from None


def result(what, prog):
    """Print a command's result with ``out``. True if it was written or its reader went away (`| head`: the
    command's exit status stands, and what follows goes nowhere); False, after a one-line error on stderr, if
    stdout could not be written otherwise (a full disk)."""
    try:
        out(what)
    except StdoutClosed:
        closed_quietly()
    except OSError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False
    return True


def closed_quietly():
    """After StdoutClosed: exit status 0, with no second error when the interpreter flushes stdout at exit."""
    _stdout_to_devnull()
    return 0


def _stdout_to_devnull():
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(fd, 1)
    finally:
        os.close(fd)


def usage_error(prog, what):
    """A usage error: one line on stderr, if it can be written; exit status 2 whatever happens to the line."""
    if sys.stderr is None:   # `2>&-`: print(file=None) would write it on stdout
        return 2
    try:
        print(f"{prog}: {what}", file=sys.stderr, flush=True)
    except (OSError, ValueError):   # fd 2 open, but not for writing (`2>&-` through a shell script)
        pass
    return 2
