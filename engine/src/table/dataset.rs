//! A Zarr group seen as tables: its dimensions, their coordinates, and the
//! sets of variables that share dimensions.
//!
//! Following xarray: a 1-D array named like its dimension is that
//! dimension's coordinate; every other array is a data variable. Variables
//! with the same dimensions (in the same order) form one table. Coordinate
//! arrays are read when the group is opened, a piece at a time, and held
//! as their formula when they follow one (see [`super::RegularCoordinate`]).
//!
//! From an object store, opening costs a few round trips whatever the
//! number of arrays: the candidate metadata documents (`zarr.json`,
//! `.zmetadata`) are requested together, then the chunks of every
//! coordinate array are requested ahead of their reading
//! ([`OPENING_READ_AHEAD`] at once). A store opened before is opened in
//! one round trip: everything the last opening read is requested at once,
//! each object only if it changed ([`crate::zarr::Opening`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Float64Type, Schema, SchemaRef};
use datafusion::common::human_readable_size;
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::RuntimeEnv;

use super::broadcast::Broadcast;
use super::coordinate::Coordinate;
use super::options::ZarrTableOptions;
use super::regular::RegularCoordinateCheck;
use crate::error::{Result, ZarrFusionError};
use zarrfusion_udfs::cf_time::CfTimeError;
use zarrfusion_udfs::model_calendar::{
    CALENDAR_METADATA, TIME_CALENDAR_METADATA, TIME_UNITS_METADATA,
};
use zarrs::storage::StoreKey;

use crate::zarr::{
    discover_arrays, open_storage, root_name, ChunkBufferPool, Opening, OpeningCache, ReadAhead,
    StoreAccess, StoreLocation, ZarrArray,
};

/// One dimension of a dataset.
#[derive(Debug)]
pub struct Dimension {
    /// The dimension's name.
    pub name: String,
    /// Its length.
    pub len: u64,
    /// Coordinate values (decoded, or their formula), or the integer index
    /// (computed) when there is no coordinate array.
    pub coordinate: Coordinate,
    /// The coordinate array's attributes (empty without one).
    pub attributes: serde_json::Map<String, serde_json::Value>,
}

impl Dimension {
    /// The dimension's column: times of a model calendar name it in their
    /// field metadata ([`CALENDAR_METADATA`]: `extract(doy FROM time)`
    /// counts its days, `COPY` writes them in it); numbers kept for its
    /// dates name their units and calendar ([`TIME_UNITS_METADATA`]:
    /// `extract(month FROM time)` reads their dates).
    pub fn field(&self) -> Field {
        let data_type = self.coordinate.data_type();
        let field = Field::new(&self.name, data_type.clone(), self.coordinate.nullable());
        let Some(time) = self.model_calendar() else {
            return field;
        };
        let calendar = time.calendar().name().to_string();
        match data_type {
            DataType::Timestamp(..) => {
                field.with_metadata(HashMap::from([(CALENDAR_METADATA.to_string(), calendar)]))
            }
            // Numbers kept for dates without a timestamp (a daily 360_day
            // calendar's 30th of February): their units and calendar, so
            // that `extract` and `date_trunc` read their dates.
            _ => match self.attributes.get("units").and_then(|u| u.as_str()) {
                Some(units) => field.with_metadata(HashMap::from([
                    (TIME_UNITS_METADATA.to_string(), units.to_string()),
                    (TIME_CALENDAR_METADATA.to_string(), calendar),
                ])),
                None => field,
            },
        }
    }

    /// The CF time encoding of its coordinate when it holds dates of a
    /// model calendar ([`super::model_calendar`]).
    pub fn model_calendar(&self) -> Option<zarrfusion_udfs::cf_time::CfTime> {
        super::model_calendar(&self.attributes)
    }

    /// Whether the dimension has a coordinate array.
    pub fn has_coordinate(&self) -> bool {
        !matches!(self.coordinate, Coordinate::Index(_))
    }

    /// Whether the coordinate runs from high to low (its first value is
    /// larger than its last), as ERA5's latitude does.
    pub fn descends(&self) -> bool {
        self.coordinate.descends()
    }

    /// The order of the coordinate values along the dimension (see
    /// [`Coordinate::strict_order`]).
    pub fn strict_order(&self) -> Option<bool> {
        self.coordinate.strict_order()
    }
}

/// An opened Zarr group: dimensions and data variables.
#[derive(Debug)]
pub struct ZarrDataset {
    store: String,
    dims: BTreeMap<String, Arc<Dimension>>,
    variables: Vec<Arc<ZarrArray>>,
    /// How it was opened.
    source: Option<TableSource>,
}

/// How a table was opened: enough for another process (a cluster's
/// worker) to open it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSource {
    /// The location, as the user wrote it.
    pub location: String,
    /// The options it was opened with (`dims`: the table's dimensions).
    pub options: ZarrTableOptions,
}

/// How a [`GridTable`] is made again in another process (a cluster's
/// worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GridSource {
    /// Opened from a location.
    Opened(TableSource),
    /// Two tables on one grid side by side ([`GridTable::zip`]).
    Zip(Box<GridSource>, Box<GridSource>),
}

/// The variables of one dimension set, ready to be a table.
#[derive(Debug)]
pub struct GridTable {
    /// The store, as the user wrote it.
    pub store: String,
    /// How to make this table again (`None`: a table made here from what
    /// another process cannot make, such as a staged transform's); for a
    /// table with tables joined in ([`Self::with_broadcast`]), how to make
    /// its grid (the joined tables travel with their operators' inputs).
    pub source: Option<GridSource>,
    /// Dimensions, outermost first.
    pub dims: Vec<Arc<Dimension>>,
    /// Data variables, sorted by name.
    pub variables: Vec<Arc<ZarrArray>>,
    /// Small tables joined in on some dimensions (see [`Broadcast`]).
    pub broadcasts: Vec<Arc<Broadcast>>,
    /// Dimension columns, then variable columns, then each broadcast's
    /// columns.
    pub schema: SchemaRef,
}

/// What a column of a [`GridTable`] is.
#[derive(Debug, Clone, Copy)]
pub enum GridColumn<'a> {
    /// A dimension, generated from its coordinate.
    Dimension(&'a Arc<Dimension>),
    /// A variable, read from its store.
    Variable(&'a Arc<ZarrArray>),
    /// Column `part` (among its [`Broadcast::fields`]) of a broadcast.
    Broadcast(&'a Arc<Broadcast>, usize),
}

#[cfg(test)]
impl GridTable {
    /// A table over one dimension `x` holding `coordinate`, without
    /// variables (for tests of what planning does with a coordinate).
    pub(crate) fn of_coordinate(coordinate: Coordinate) -> Self {
        let field = Field::new("x", coordinate.data_type(), coordinate.nullable());
        Self {
            store: "test".into(),
            source: None,
            dims: vec![Arc::new(Dimension {
                name: "x".into(),
                len: coordinate.len(),
                coordinate,
                attributes: Default::default(),
            })],
            variables: vec![],
            broadcasts: vec![],
            schema: Arc::new(Schema::new(vec![field])),
        }
    }
}

impl GridTable {
    /// What column `i` (an index into the schema) is.
    pub fn column(&self, i: usize) -> Option<GridColumn<'_>> {
        if let Some(dim) = self.dims.get(i) {
            return Some(GridColumn::Dimension(dim));
        }
        let i = i - self.dims.len();
        if let Some(variable) = self.variables.get(i) {
            return Some(GridColumn::Variable(variable));
        }
        let (k, part) = self.broadcast_of(i + self.dims.len())?;
        Some(GridColumn::Broadcast(&self.broadcasts[k], part))
    }

    /// The variable that column `i` is, if it is one.
    pub fn variable(&self, i: usize) -> Option<&Arc<ZarrArray>> {
        match self.column(i) {
            Some(GridColumn::Variable(v)) => Some(v),
            _ => None,
        }
    }

    /// The broadcast (index into [`Self::broadcasts`]) and its column that
    /// column `i` is, if it is one.
    pub fn broadcast_of(&self, i: usize) -> Option<(usize, usize)> {
        let mut at = i.checked_sub(self.dims.len() + self.variables.len())?;
        for (k, b) in self.broadcasts.iter().enumerate() {
            if at < b.fields.len() {
                return Some((k, at));
            }
            at -= b.fields.len();
        }
        None
    }

    /// The broadcasts that `columns` (indices into the schema) read.
    pub fn broadcasts_read(&self, columns: &[usize]) -> Vec<Arc<Broadcast>> {
        (self.broadcasts.iter().enumerate())
            .filter(|(k, _)| {
                (columns.iter()).any(|&c| self.broadcast_of(c).is_some_and(|(b, _)| b == *k))
            })
            .map(|(_, b)| Arc::clone(b))
            .collect()
    }

    /// The dimensions' names, outermost first.
    pub fn dim_names(&self) -> Vec<&str> {
        self.dims.iter().map(|d| d.name.as_str()).collect()
    }

    /// Bytes a cell of column `i` takes as read (a variable's stored
    /// element, a broadcast's value; nothing for a dimension, which is
    /// generated).
    pub fn cell_bytes(&self, i: usize) -> usize {
        match self.column(i) {
            Some(GridColumn::Variable(v)) => v.element_size(),
            Some(GridColumn::Broadcast(b, part)) => b.part_bytes(part),
            _ => 0,
        }
    }

    /// Decoded bytes a cell of the variables among `columns` takes (the
    /// others are generated or sliced, not decoded).
    pub fn decoded_cell_bytes(&self, columns: &[usize]) -> u64 {
        (columns.iter())
            .filter_map(|&i| self.variable(i))
            .map(|v| v.element_size() as u64)
            .sum()
    }

    /// Bytes a cell of column `i` takes at the peak of reading it (stored
    /// and decoded, for a variable).
    pub fn peak_cell_bytes(&self, i: usize) -> usize {
        match self.column(i) {
            Some(GridColumn::Variable(v)) => v.peak_bytes_per_cell(),
            Some(GridColumn::Broadcast(b, part)) => 2 * b.part_bytes(part),
            _ => 0,
        }
    }

    /// This table with `broadcast`'s columns added after the others.
    pub fn with_broadcast(&self, broadcast: Broadcast) -> GridTable {
        let mut fields: Vec<Field> = (self.schema.fields().iter())
            .map(|f| f.as_ref().clone())
            .collect();
        fields.extend(broadcast.fields.iter().cloned());
        let mut broadcasts = self.broadcasts.clone();
        broadcasts.push(Arc::new(broadcast));
        GridTable {
            store: self.store.clone(),
            source: self.source.clone(),
            dims: self.dims.clone(),
            variables: self.variables.clone(),
            broadcasts,
            schema: Arc::new(Schema::new(fields)),
        }
    }

    /// The object-store options the table was opened with (its `OPTIONS`;
    /// empty for a local store or a table made here), for reading its
    /// store again with the same client.
    pub fn storage_options(&self) -> HashMap<String, String> {
        match &self.source {
            Some(GridSource::Opened(source)) => source.options.storage.clone(),
            _ => HashMap::new(),
        }
    }

    /// The grid of this table and `other` when they share one: their
    /// dimensions have equal coordinates, each matching once (strictly
    /// monotonic, no NULL, no NaN), and neither has a table joined in. Its
    /// columns are this table's dimensions and variables, then `other`'s
    /// variables (renamed `name_1`, `name_2`, ... where a name is taken),
    /// each variable read from its own store.
    pub fn zip(&self, other: &GridTable) -> Option<GridTable> {
        let n_dims = self.dims.len();
        let same_grid = other.dims.len() == n_dims
            && self.dims.iter().zip(&other.dims).all(|(x, y)| {
                x.len == y.len
                    && x.coordinate.same_values(&y.coordinate)
                    && x.coordinate.distinct_order().is_some()
            });
        if !same_grid || !self.broadcasts.is_empty() || !other.broadcasts.is_empty() {
            return None;
        }
        let mut names: HashSet<String> = (self.schema.fields().iter())
            .map(|f| f.name().clone())
            .collect();
        let mut fields: Vec<Field> = (self.schema.fields().iter())
            .map(|f| f.as_ref().clone())
            .collect();
        for field in other.schema.fields().iter().skip(n_dims) {
            let mut name = field.name().clone();
            let mut n = 1;
            while names.contains(&name) {
                name = format!("{}_{n}", field.name());
                n += 1;
            }
            names.insert(name.clone());
            fields.push(field.as_ref().clone().with_name(name));
        }
        let mut variables = self.variables.clone();
        variables.extend(other.variables.iter().cloned());
        let source = match (&self.source, &other.source) {
            (Some(a), Some(b)) => Some(GridSource::Zip(Box::new(a.clone()), Box::new(b.clone()))),
            _ => None,
        };
        Some(GridTable {
            store: format!("{} + {}", self.store, other.store),
            source,
            dims: self.dims.clone(),
            variables,
            broadcasts: Vec::new(),
            schema: Arc::new(Schema::new(fields)),
        })
    }

    /// The grid's shape.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().map(|d| d.len).collect()
    }

    /// The chunk shape blocks align to: the first variable's storage chunks.
    pub fn chunk_shape(&self) -> Vec<u64> {
        self.variables
            .first()
            .map(|v| v.chunk_shape())
            .unwrap_or_else(|| self.shape())
    }

    /// This table with its dimensions replaced by `dims` (the same names
    /// and lengths, in order; coordinates and attributes as they say): for
    /// a store whose reader knows the coordinates better than the store
    /// holds them, such as a staged transform's output, written without
    /// coordinate arrays so that opening it reads none.
    pub fn with_dimensions(self, dims: Vec<Arc<Dimension>>) -> Result<GridTable> {
        let same = dims.len() == self.dims.len()
            && dims
                .iter()
                .zip(&self.dims)
                .all(|(a, b)| a.name == b.name && a.len == b.len && a.coordinate.len() == a.len);
        if !same {
            let describe = |dims: &[Arc<Dimension>]| {
                dims.iter()
                    .map(|d| format!("{} ({})", d.name, d.len))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(ZarrFusionError::store(
                &self.store,
                format!(
                    "its dimensions [{}] are not the ones given [{}]",
                    describe(&self.dims),
                    describe(&dims)
                ),
            ));
        }
        let mut fields: Vec<Field> = dims.iter().map(|d| d.field()).collect();
        fields.extend(
            self.schema.fields()[self.dims.len()..]
                .iter()
                .map(|f| f.as_ref().clone()),
        );
        // Opened again, the store would give its own coordinates.
        Ok(GridTable {
            dims,
            schema: Arc::new(Schema::new(fields)),
            source: None,
            ..self
        })
    }

    /// Number of cells (rows).
    pub fn num_rows(&self) -> u64 {
        self.shape().iter().product()
    }

    /// Names of the dimensions, joined by `_` (the table's name in a schema).
    pub fn dims_name(&self) -> String {
        self.dims
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>()
            .join("_")
    }
}

impl ZarrDataset {
    /// Opens the store at `location` and checks that every variable agrees
    /// with its dimensions. Runs blocking IO: call it from a blocking thread.
    pub fn open(location: &str, options: &ZarrTableOptions, runtime: &RuntimeEnv) -> Result<Self> {
        let mut resolved = StoreLocation::parse(location)?;
        if let Some(group) = &options.group {
            resolved = resolved.join(group);
        }
        options.allowed.check(&resolved, location)?;
        options.allowed.check_options(&options.storage, location)?;
        let opened = open_storage(
            location,
            &resolved,
            &options.storage,
            &options.storage_defaults,
            runtime,
        )?;
        let remote = match &opened.access {
            StoreAccess::Remote(remote) => Some(Arc::clone(remote)),
            StoreAccess::Local(_) => None,
        };
        // A v3 store has `zarr.json`, a consolidated v2 store `.zmetadata`:
        // both are asked for at once; with the opening cache, so is
        // everything the last opening of the store read.
        let opening = remote.as_ref().map(|remote| {
            let keys = ["zarr.json", ".zmetadata"]
                .into_iter()
                .filter_map(|k| StoreKey::new(k).ok())
                .collect();
            let cache = (options.uses_open_cache() && resolved.is_networked())
                .then(OpeningCache::default_location)
                .flatten();
            Opening::start(Arc::clone(remote), cache, keys)
        });
        let entries = discover_arrays(&opened, location, root_name(location))?;
        let arrays = entries
            .into_iter()
            .map(|entry| {
                ZarrArray::open(&opened.storage, location, entry, &opened.access).map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        let lengths = dimension_lengths(location, &arrays)?;
        // The coordinates' chunks, in the order they are read.
        let _coordinates = remote.map(|remote| {
            let keys: Vec<StoreKey> = arrays
                .iter()
                .filter(|a| is_coordinate(a))
                .flat_map(|a| {
                    let mut keys = a.chunk_keys(std::slice::from_ref(&(0..a.shape()[0])));
                    // The first and last chunks are read first.
                    if keys.len() > 2 {
                        let last = keys.remove(keys.len() - 1);
                        keys.insert(1, last);
                    }
                    keys
                })
                .collect();
            let largest = arrays
                .iter()
                .filter(|a| is_coordinate(a))
                .map(|a| a.chunk_bytes())
                .max()
                .unwrap_or(0);
            let depth = (OPENING_READ_AHEAD_BYTES / largest.max(1)).clamp(1, OPENING_READ_AHEAD);
            // A coordinate is read a piece at a time: a piece of a chunk
            // takes it, as the window runs on.
            ReadAhead::keys(remote, keys, depth)
        });
        let memory_limit = match runtime.memory_pool.memory_limit() {
            MemoryLimit::Finite(limit) => Some(limit as u64),
            _ => None,
        };
        let mut dataset = Self::from_arrays(location, arrays, lengths, memory_limit)?;
        dataset.source = Some(TableSource {
            location: location.to_string(),
            options: options.clone(),
        });
        if let Some(opening) = opening {
            opening.finish();
        }
        Ok(dataset)
    }

    /// The dataset of `arrays`, whose dimensions' `lengths` were checked
    /// by [`dimension_lengths`]: reads the coordinate arrays.
    fn from_arrays(
        store: &str,
        arrays: Vec<Arc<ZarrArray>>,
        lengths: BTreeMap<String, u64>,
        memory_limit: Option<u64>,
    ) -> Result<Self> {
        let mut arrays = arrays;
        let mut dims = BTreeMap::new();
        for array in arrays.iter_mut().filter(|a| is_coordinate(a)) {
            let dim = Dimension {
                name: array.name().to_string(),
                len: array.shape()[0],
                coordinate: read_dates_or_numbers(array, memory_limit)?,
                attributes: array.attributes().clone(),
            };
            dims.insert(dim.name.clone(), Arc::new(dim));
        }
        for (name, len) in lengths {
            if dims.contains_key(&name) {
                continue;
            }
            let dim = Dimension {
                name: name.clone(),
                len,
                coordinate: Coordinate::Index(len),
                attributes: serde_json::Map::new(),
            };
            dims.insert(name, Arc::new(dim));
        }
        let variables: Vec<Arc<ZarrArray>> = arrays
            .into_iter()
            .filter(|a| !is_coordinate(a) && !a.dims().is_empty())
            .collect();
        Ok(Self {
            store: store.to_string(),
            dims,
            variables,
            source: None,
        })
    }

    /// The store's location, as the user gave it.
    pub fn store(&self) -> &str {
        &self.store
    }

    /// The distinct dimension sets of the data variables, in order of first appearance
    /// (variables are sorted by name).
    pub fn dimension_sets(&self) -> Vec<Vec<String>> {
        let mut sets: Vec<Vec<String>> = Vec::new();
        for var in &self.variables {
            if !sets.iter().any(|s| s.as_slice() == var.dims()) {
                sets.push(var.dims().to_vec());
            }
        }
        sets
    }

    /// The table of one dimension set: `dims` names it (in any order), or
    /// `None` picks the set with the most dimensions (then the most variables).
    pub fn table(&self, dims: Option<&[String]>) -> Result<GridTable> {
        let sets = self.dimension_sets();
        let describe = || {
            sets.iter()
                .map(|s| format!("({})", s.join(", ")))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let chosen = match dims {
            Some(wanted) => {
                let mut wanted_sorted = wanted.to_vec();
                wanted_sorted.sort();
                sets.iter()
                    .find(|s| {
                        let mut sorted = s.to_vec();
                        sorted.sort();
                        sorted == wanted_sorted
                    })
                    .ok_or_else(|| {
                        ZarrFusionError::store(
                            &self.store,
                            format!(
                                "dims '{}' name no dimension set; the store has: {}",
                                wanted.join(","),
                                describe()
                            ),
                        )
                    })?
            }
            None => sets
                .iter()
                .max_by_key(|s| {
                    let count = self
                        .variables
                        .iter()
                        .filter(|v| v.dims() == s.as_slice())
                        .count();
                    (s.len(), count)
                })
                .ok_or_else(|| {
                    ZarrFusionError::store(&self.store, "the store has no data variables")
                })?,
        };
        Ok(self.build_table(chosen))
    }

    /// Every dimension set as a table.
    pub fn tables(&self) -> Vec<GridTable> {
        self.dimension_sets()
            .iter()
            .map(|set| self.build_table(set))
            .collect()
    }

    fn build_table(&self, set: &[String]) -> GridTable {
        let dims: Vec<Arc<Dimension>> = set.iter().map(|d| Arc::clone(&self.dims[d])).collect();
        let variables: Vec<Arc<ZarrArray>> = self
            .variables
            .iter()
            .filter(|v| v.dims() == set)
            .cloned()
            .collect();
        let mut fields: Vec<Field> = dims.iter().map(|d| d.field()).collect();
        fields.extend(
            variables
                .iter()
                .map(|v| Field::new(v.name(), v.data_type().clone(), true)),
        );
        let source = self.source.as_ref().map(|source| TableSource {
            location: source.location.clone(),
            options: ZarrTableOptions {
                dims: Some(set.to_vec()),
                ..source.options.clone()
            },
        });
        GridTable {
            store: self.store.clone(),
            source: source.map(GridSource::Opened),
            dims,
            variables,
            broadcasts: Vec::new(),
            schema: Arc::new(Schema::new(fields)),
        }
    }
}

/// Positions of a coordinate array read at a time when it is checked for a
/// formula (rounded up to whole chunks).
const COORDINATE_PIECE: u64 = 1 << 18;

/// Most decoded bytes of one coordinate array (512 Mi `float64` values):
/// every coordinate is read when its store is opened, so a larger one
/// (metadata declaring an absurd length) is refused before anything is
/// read. A coordinate that does not follow a formula is also held whole,
/// so it must fit the memory limit besides.
const COORDINATE_READ_BYTES: u64 = 4 << 30;

/// Chunks of coordinate arrays requested at once while a remote store is
/// opened.
const OPENING_READ_AHEAD: usize = 16;

/// Most bytes those chunks hold (decoded sizes).
const OPENING_READ_AHEAD_BYTES: usize = 64 << 20;

/// The length of every dimension the variables among `arrays` use, from
/// their metadata alone: a coordinate array's, else the first variable's
/// that uses it. Every variable must agree; checked before any coordinate
/// is read, so a store whose lengths disagree is refused without reading
/// a coordinate of any length.
fn dimension_lengths(store: &str, arrays: &[Arc<ZarrArray>]) -> Result<BTreeMap<String, u64>> {
    let mut lengths: BTreeMap<String, (u64, String)> = (arrays.iter())
        .filter(|a| is_coordinate(a))
        .map(|a| {
            let name = a.name().to_string();
            let from = format!("its coordinate array '{name}'");
            (name, (a.shape()[0], from))
        })
        .collect();
    for var in arrays.iter().filter(|a| !is_coordinate(a)) {
        for (dim, len) in var.dims().iter().zip(var.shape()) {
            let (expected, from) = lengths
                .entry(dim.clone())
                .or_insert_with(|| (*len, format!("array '{}'", var.name())));
            if *expected != *len {
                return Err(ZarrFusionError::array(
                    store,
                    var.name(),
                    format!(
                        "its shape {:?} disagrees with dimension '{dim}': length {len} here, \
                         {expected} in {from}",
                        var.shape(),
                    ),
                ));
            }
        }
    }
    Ok(lengths
        .into_iter()
        .map(|(name, (len, _))| (name, len))
        .collect())
}

/// Whether `array` is its dimension's coordinate (1-D, named like it).
fn is_coordinate(array: &ZarrArray) -> bool {
    array.dims().len() == 1 && array.dims()[0] == array.name() && !array.name().is_empty()
}

/// A coordinate array's values: held as their formula when they follow
/// one (see [`super::RegularCoordinate`]), else decoded and held. Reads
/// the array a piece at a time while it is checked, so a regular one is
/// never whole in memory.
fn read_coordinate(array: &ZarrArray, memory_limit: Option<u64>) -> Result<Coordinate> {
    let len = array.shape()[0];
    let bytes = len.saturating_mul(array.element_size() as u64);
    let refuse = |what: String| {
        ZarrFusionError::array(
            array.store(),
            array.name(),
            format!(
                "the coordinate has {len} values ({} decoded), more than {what}; coordinates \
                 are read when a store is opened",
                human_readable_size(usize::try_from(bytes).unwrap_or(usize::MAX))
            ),
        )
    };
    if bytes > COORDINATE_READ_BYTES {
        return Err(refuse(format!(
            "the {} a coordinate may have",
            human_readable_size(COORDINATE_READ_BYTES as usize)
        )));
    }
    let pool = ChunkBufferPool::new();
    let read = |range: std::ops::Range<u64>| array.read(std::slice::from_ref(&range), &pool);
    let chunk = array.chunk_shape()[0].max(1);
    let piece = COORDINATE_PIECE.div_ceil(chunk) * chunk;
    // Read whole (a short one), or held whole (one that follows no
    // formula): it must fit the memory limit.
    let held_whole = || match memory_limit.filter(|&limit| bytes > limit) {
        Some(limit) => Err(refuse(format!(
            "the memory limit (allowed_mem) of {} holds",
            human_readable_size(usize::try_from(limit).unwrap_or(usize::MAX))
        ))),
        None => Ok(()),
    };
    if piece >= len {
        held_whole()?;
        return Ok(regular(read(0..len)?));
    }
    // The first two values and the last suggest the formulas; then every
    // value is checked, one piece in memory at a time.
    if let Some(mut check) = RegularCoordinateCheck::new(&read(0..2)?, &read(len - 1..len)?, len) {
        let (mut holds, mut offset) = (true, 0);
        while holds && offset < len {
            holds = check.check(&read(offset..len.min(offset + piece))?);
            offset += piece;
        }
        if let Some(regular) = check.finish() {
            return Ok(Coordinate::Regular(Arc::new(regular)));
        }
    }
    held_whole()?;
    Ok(Coordinate::Values(read(0..len)?))
}

/// A coordinate's values ([`read_coordinate`]); dates of a calendar some
/// of whose days have no timestamp keep their numbers when one of them is
/// such a day (a daily `360_day` calendar's 30th of February), as xarray's
/// `CFTimeIndex.to_datetimeindex()` refuses them, with a warning naming it.
fn read_dates_or_numbers(
    array: &mut Arc<ZarrArray>,
    memory_limit: Option<u64>,
) -> Result<Coordinate> {
    let error = match read_coordinate(array, memory_limit) {
        Err(error) => error,
        read => return read,
    };
    let Some(time) = array.decoder().dates_lacking_timestamps().copied() else {
        return Err(error);
    };
    // Opened just now, the array is this dataset's alone.
    let Some(opened) = Arc::get_mut(array) else {
        return Err(error);
    };
    opened.keep_numbers();
    let numbers = read_coordinate(array, memory_limit)?;
    let lacking = numbers.pieces(COORDINATE_PIECE).find_map(|piece| {
        let piece = piece.and_then(|p| cast(&p, &DataType::Float64)).ok()?;
        let values = piece.as_primitive::<Float64Type>().iter().flatten();
        values
            .map(|v| time.decode_f64(v))
            .find_map(|decoded| match decoded {
                Err(lacking @ CfTimeError::NoTimestamp { .. }) => Some(lacking),
                _ => None,
            })
    });
    match lacking {
        Some(lacking) => {
            log::warn!(
                "store '{}' array '{}': {lacking}; the coordinate keeps its numbers",
                array.store(),
                array.name(),
            );
            Ok(numbers)
        }
        // Something else failed.
        None => Err(error),
    }
}

/// Coordinate values read whole, held as their formula when they follow
/// one.
fn regular(values: ArrayRef) -> Coordinate {
    if values.len() < 2 {
        return Coordinate::Values(values);
    }
    let last = values.slice(values.len() - 1, 1);
    let formula =
        RegularCoordinateCheck::new(&values, &last, values.len() as u64).and_then(|mut check| {
            check.check(&values);
            check.finish()
        });
    match formula {
        Some(formula) => Coordinate::Regular(Arc::new(formula)),
        None => Coordinate::Values(values),
    }
}
