"""Text corpora and the calibration / held-out token sets built from them (the `tokens`
stage of a run): below the stages, which take TokenSets as their input."""
