"""Helpers shared by the tests and the benchmarks: forked gloo ranks (`ranks.launch`) and the tally of what
autograd saves for backward (`activations.saved_tally`). This package imports only torch, never `hybrid`'s
own rooms, so any test or benchmark may use it."""
