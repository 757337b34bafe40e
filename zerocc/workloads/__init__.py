"""Ready workloads a plan can name (`workload: "zerocc.workloads.<module>:<function>"`), so
`zerocc train` trains a model without a workload of the user's own."""
