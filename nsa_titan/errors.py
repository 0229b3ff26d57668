"""Exit codes of ``python -m nsa_titan.train`` and the base class of the failures that end a run with one.

Imports nothing from nsa_titan, so every layer can raise them: the checkpoint package (a full disk), the fault
package (non-finite loss, dead peer) and the trainer. The README's table of exit codes lists the same numbers.
"""

EXIT_FAILURE = 1  # any other failure (TrainingFailure's default)
EXIT_CONFIG = 2  # a ConfigError: a bad setting, unusable data, an unwritable folder (the message names the key)
EXIT_NONFINITE = 3  # fault.nonfinite = 'stop' found a NaN/inf loss or grad norm
EXIT_WATCHDOG = 4  # no step finished within fault.watchdog_timeout_s
EXIT_PEER_FAILED = 5  # another rank died, hung or failed
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): the shell's 128 + signal number
EXIT_TERMINATED = 143  # SIGTERM (preemption)


class TrainingFailure(RuntimeError):
    """A failure the trainer detected itself; ``python -m nsa_titan.train`` prints its message (no traceback) and
    exits with ``exit_code``."""

    exit_code = EXIT_FAILURE
