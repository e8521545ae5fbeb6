"""A whole hidden-state training set checked file by file: structure, values and slot identity,
on one machine or on a Ray cluster."""
