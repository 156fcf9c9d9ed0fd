"""Process infrastructure, below everything else: CPU shims, collective devices, process groups,
the console and run log, seeding, process hygiene."""
