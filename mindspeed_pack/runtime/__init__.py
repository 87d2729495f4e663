"""The process runtime every entry point stands on: process groups and rendezvous (``process_groups``,
``rendezvous``), peers that die or hang (``peers``), signals (``exit_signal``), the CPU shim that lets
megatron-core run without CUDA (``platform``) and crash-test fault injection (``faults``).

The ground floor: imports nothing of mindspeed_pack outside this package.
"""
