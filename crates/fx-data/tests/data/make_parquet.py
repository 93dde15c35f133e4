"""Writes the Parquet fixtures of fx-data's tests from the shipped bar CSVs (../shared/data),
as pandas + pyarrow write them for a user: run from this folder with pandas and pyarrow
installed (written with pandas 3.1.1, pyarrow 26.0.1).

- stocks_long.parquet: the three stocks in long format (symbol = the CSV's file stem), rows
  sorted by date then symbol, `date` as timestamp[ns] (pandas' datetime64[ns]), prices
  float64, volume int64, the pandas index kept as a column, zstd (polars' default codec).
- msft_date32.parquet: MSFT alone, `timestamp` as a date32 column, snappy (pyarrow's default).
"""
import pathlib

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

data = pathlib.Path(__file__).resolve().parents[5] / "shared" / "data"
frames = []
for p in sorted(data.glob("*_daily_2000_2013.csv")):
    f = pd.read_csv(p)
    f.insert(1, "symbol", p.stem)
    frames.append(f)
long = pd.concat(frames).rename(columns={"timestamp": "date"})
long["date"] = pd.to_datetime(long["date"]).astype("datetime64[ns]")
long = long.sort_values(["date", "symbol"], kind="stable").reset_index(drop=True)
long["volume"] = long["volume"].astype("int64")
pq.write_table(pa.Table.from_pandas(long, preserve_index=True), "stocks_long.parquet", compression="zstd")

msft = pd.read_csv(data / "msft_daily_2000_2013.csv")
t = pa.table({
    "timestamp": pa.array(pd.to_datetime(msft["timestamp"]).dt.date, type=pa.date32()),
    **{c: pa.array(msft[c], type=pa.float64()) for c in ["open", "high", "low", "close", "volume"]},
})
pq.write_table(t, "msft_date32.parquet", compression="snappy")
