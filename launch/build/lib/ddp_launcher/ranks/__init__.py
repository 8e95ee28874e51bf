"""How a rank process starts: the code of the processes a launcher starts (it imports only
core/). Each file says what it does; docs/architecture.md says more.
"""
