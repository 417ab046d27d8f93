"""Studies that train many small runs and compare them: the anchor-function study of small
initialization (anchor_task, anchor_config, anchor_cells, anchor_study) and the multi-seed
stacking study (stacking_config, study_arms, stacking_study, matched_loss, stacking_study_page)."""
