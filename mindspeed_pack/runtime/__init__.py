"""The process runtime every entry point stands on: process groups and rendezvous (``process_groups``,
``rendezvous``), peers that die or hang (``peers``), signals (``exit_signal``), the CPU shim that lets
megatron-core run without CUDA (``platform``), crash-test fault injection (``faults``), and the
temporaries a killed writer leaves, named after their owner and removed once it is gone, with the lock
that lets one job build an output while the others wait (``stale_files``).

The ground floor: imports nothing of mindspeed_pack outside this package.
"""
