"""What the training scripts share around their ``main``: logging and bad-input exits."""
from __future__ import annotations

import logging
import sys

from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.datasets.packed_documents import DataError
from mindspeed_pack.runtime import error_scope, process_groups
from mindspeed_pack.runtime.disk import DiskFullError
from mindspeed_pack.runtime.peers import PeerFailure
from mindspeed_pack.runtime.process_groups import LaunchError
from mindspeed_pack.runtime.rendezvous import RendezvousTimeout, announce_stop
from mindspeed_pack.training.trainer import NonFiniteLossError


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # keep the console for our step lines


def _print_error(script: str, error: BaseException) -> None:
    """The ``error:`` line, on the ranks that print an error of its scope (a refusal of the flags every rank parsed
    alike: rank 0 only; :mod:`mindspeed_pack.runtime.error_scope`)."""
    if error_scope.prints_here(error_scope.scope_of(error)):
        print(f"{script}: error: {error}", file=sys.stderr)


def run_cli(script: str, main, own_process: bool = False) -> None:
    """Run ``main()``; bad input (flags, data, checkpoint) ends with one ``error:`` line and exit 2,
    a rank stopping before the ranks met tells them why (they stop too, at once: ``rendezvous.announce_stop``),
    a diverged run (``--nan-policy stop``) with one line naming the iteration and exit 1, a dead or
    hung peer with one line naming what this rank waited for and exit 1 (torchrun then restarts).

    ``own_process`` (a script's ``__main__``): the process groups are destroyed before the interpreter exits, unless
    a peer was lost (a collective may still wait on it). Left to the interpreter's teardown, gloo's threads could
    abort it ("terminate called without an active exception", exit 134 instead of the run's code)."""
    peers_alive = True
    try:
        main()
    # the message says what and where (or how to start); ArgumentError: a check after the parser's (a stage's flags)
    except (CheckpointError, DataError, LaunchError, ArgumentError) as e:
        _print_error(script, e)
        announce_stop(str(e))  # before the ranks met, the others would wait for this rank until their timeout
        sys.exit(2)
    except (NonFiniteLossError, DiskFullError) as e:
        _print_error(script, e)
        sys.exit(1)
    except (PeerFailure, RendezvousTimeout) as e:
        peers_alive = False
        _print_error(script, e)
        sys.exit(1)
    except SystemExit as e:  # --help, a usage error, a clean early exit
        peers_alive = e.code in (0, None)
        if not peers_alive:  # its message is already on this node's console
            announce_stop(f"{script} exited with status {e.code} (its error line is in that node's log)")
        raise
    except BaseException:  # a traceback, Ctrl-C: nothing says which collective is still waiting
        peers_alive = False
        raise
    finally:
        if own_process and peers_alive:
            process_groups.destroy()
