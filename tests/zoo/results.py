"""The zoo's results of this test run: (model, partitions, schedule) -> worst relative error."""

RESULTS = {}
