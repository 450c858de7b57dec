"""Reports from results only, in two steps. Analysis: the runs read (load, samples), grouped and set
against a baseline by the one engine (groups, on the statistics of stats), arranged as the table of
groups (aggregate), the study (study, study_model, study_header) or a comparison (compare). Render:
those as text cells and documents (tables, group_table, answer, document, compare_render), figures,
and the terminal, Markdown, HTML, CSV and JSON writers. What is published from committed results
(declared reports, the results index, the docs tables) is lora_bench.publish, above this package."""
